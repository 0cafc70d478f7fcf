"""SQuAD v2 (Table L.1): the Apertus task reads the validation split (answerable and unanswerable
questions) and scores each visible answer by the official SQuAD 2.0 rule, with "unanswerable" read as
the empty answer; its base variant asks the same prompt through the completions API. (The chat task
runs end to end against the served checkpoint in test_lm_eval_tasks.py's lm-eval run.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eval_tasks.catalogue import by_id, mismatches
from eval_tasks.derive import base_generation_kwargs, generation_kwargs, include_path
from eval_tasks.lm_eval.squad_v2 import utils

ANSWERABLE = {"id": "a", "title": "T", "context": "c", "question": "q",
              "answers": {"text": ["the Eiffel Tower", "Eiffel Tower in Paris"], "answer_start": [0, 4]}}
UNANSWERABLE = {"id": "u", "title": "T", "context": "c", "question": "q", "answers": {"text": [], "answer_start": []}}


def _f1_em(doc: dict, response: str) -> tuple[float, float]:
    s = utils.process_results(doc, [response])
    assert s["degenerate"] == 0.0
    return s["f1"], s["exact_match"]


def test_the_row_runs_f1_on_the_post_trained_and_the_base_model() -> None:
    b = by_id()["squad_v2"]
    assert b.runnable and b.tasks == {"off": "apertus_squad_v2", "base": "apertus_squad_v2_base"}
    assert b.rows[0].metric == "f1,none" and {"post-trained-text", "base"} <= set(b.suites)
    assert b.kind_in("off") == "handwritten" and b.kind_in("base") == "base"
    assert b.chat_in("off") and not b.chat_in("base") and b.need("tokenizer", "base") == ""
    for mode, value in (("off", 32.0), ("base", 17.6)):
        ref = b.rows[0].reference[mode]
        assert ref.value == value and not mismatches(b, mode, ref), ref.cite()
    assert {m: r.value for m, r in b.reference_70b.items()} == {"off": 19.1, "base": 19.1}


def test_answerable_questions_score_token_overlap_against_the_best_gold() -> None:
    assert _f1_em(ANSWERABLE, "The Eiffel Tower.") == (1.0, 1.0)  # case, article and punctuation aside
    # "eiffel tower paris": against "eiffel tower" F1 0.8, against "eiffel tower in paris" precision 1, recall 3/4
    assert _f1_em(ANSWERABLE, "Eiffel Tower, Paris") == pytest.approx((2 * 1.0 * 0.75 / 1.75, 0.0))
    assert _f1_em(ANSWERABLE, "Answer: **Eiffel tower**\nIt is in Paris.") == (1.0, 1.0)  # the answer line
    assert _f1_em(ANSWERABLE, "the Louvre") == (0.0, 0.0)
    assert _f1_em(ANSWERABLE, "unanswerable") == (0.0, 0.0)  # "no answer" where there is one
    assert _f1_em(ANSWERABLE, "<|inner_prefix|>the Louvre?<|inner_suffix|>Eiffel Tower") == (1.0, 1.0)  # thinking stripped
    assert utils.f1("eiffel tower", "tower tower") == pytest.approx(2 * 0.5 * 0.5 / 1.0)  # counted once each


def test_unanswerable_questions_score_one_only_for_the_empty_answer() -> None:
    for reply in ("unanswerable", "Unanswerable.", "Answer: unanswerable", "The question is unanswerable.", "", "  \n"):
        assert _f1_em(UNANSWERABLE, reply) == (1.0, 1.0), reply
    for reply in ("Bern", "I don't know, maybe Bern"):
        assert _f1_em(UNANSWERABLE, reply) == (0.0, 0.0), reply
    assert utils.gold_answers(UNANSWERABLE) == [""] and utils.doc_to_target(UNANSWERABLE) == "unanswerable"
    assert utils.gold_answers({"answers": {"text": ["the", "a"]}}) == [""]  # golds that normalise to nothing
    with pytest.raises(ValueError, match=r"apertus_squad_v2, item 'x': answers"):
        utils.gold_answers({"id": "x", "answers": {"text": "Bern"}})


def test_the_answerable_and_unanswerable_shares_average_apart() -> None:
    items = [utils.score(ANSWERABLE, "Eiffel Tower"), utils.score(ANSWERABLE, "Louvre"), utils.score(UNANSWERABLE, "x")]
    assert utils.mean_where([s["has_ans_f1"] for s in items]) == 0.5
    assert utils.mean_where([s["no_ans_f1"] for s in items]) == 0.0
    assert utils.mean_where([]) == 0.0


def test_the_task_reads_every_validation_question_and_asks_for_unanswerable(data_env: Path) -> None:
    from _fixtures import SQUAD_V2

    docs = list(utils.load()["validation"])
    assert [d["id"] for d in docs] == [d["id"] for d in SQUAD_V2]
    prompt = utils.doc_to_text(docs[1])
    assert '"unanswerable"' in prompt and docs[1]["question"] in prompt and prompt.endswith("\n\nAnswer:")
    assert [utils.doc_to_target(d) for d in docs] == ["Zurich", "unanswerable"]


def test_the_base_variant_generates_the_answer_line_without_the_protocols_chat_settings() -> None:
    folder = include_path("lm_eval")
    chat = yaml.safe_load((folder / "apertus_squad_v2.yaml").read_text().replace("!function", ""))
    base = yaml.safe_load((folder / "apertus_squad_v2_base.yaml").read_text().replace("!function", ""))
    assert chat["generation_kwargs"] == generation_kwargs("off")
    assert base["generation_kwargs"] == base_generation_kwargs() and "chat_template_kwargs" not in base["generation_kwargs"]
    assert base["include"] == chat["include"] and base["task"] == "apertus_squad_v2_base"
