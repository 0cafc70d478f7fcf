"""IFBench (Tables 23 and 25): the Apertus task reads the local copy of IFBench_test and scores each
visible answer with lighteval's IFBench instruction checkers; a checker without its nltk data stops
the task naming the item, the instruction and the fix. (The task runs end to end against the served
checkpoint in test_lm_eval_tasks.py's lm-eval run.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from eval_tasks.catalogue import by_id, mismatches
from eval_tasks.lm_eval.ifbench import utils


@pytest.fixture
def docs(data_env: Path) -> dict[int, dict]:
    """The fixture's items as the task loads them."""
    return {int(d["key"]): d for d in utils.load()["train"]}


def _scores(doc: dict, response: str) -> tuple[float, float, list[bool], float]:
    s = utils.process_results(doc, [response])
    assert s["degenerate"] == 0.0
    return s["prompt_level_strict_acc"], s["prompt_level_loose_acc"], s["inst_level_strict_acc"], s["checker_error"]


def test_the_row_runs_prompt_level_strict_accuracy_with_and_without_thinking() -> None:
    b = by_id()["ifbench"]
    assert b.runnable and b.tasks == {"off": "apertus_ifbench", "think": "apertus_ifbench_think"}
    assert b.rows[0].metric == "prompt_level_strict_acc,none" and {"post-trained-text", "thinking"} <= set(b.suites)
    for mode, value in (("off", 35.3), ("think", 44.3)):
        ref = b.rows[0].reference[mode]
        assert (ref.table, ref.value) == ("25", value) and not mismatches(b, mode, ref), ref.cite()
    assert mismatches(b, "off", b.rows[0].reference["think"]) == ["thinking: the report's on, ours off"]


def test_answers_are_scored_by_lightevals_checkers(docs: dict[int, dict]) -> None:
    numbers, aare, ticket = docs[1001], docs[1002], docs[1003]
    # count:numbers (N=3): three numbers obey, one does not; the thinking span is not the answer
    assert _scores(numbers, "Geneva 580, Constance 536 and Neuchatel 218.") == (1.0, 1.0, [True], 0.0)
    assert _scores(numbers, "Geneva covers 580 square kilometres.") == (0.0, 0.0, [False], 0.0)
    assert _scores(numbers, "<think>1 2 3 4 5</think>Geneva 580, Constance 536 and Neuchatel 218.")[0] == 1.0
    # count:word_count_range (5-12) and format:emoji: both, one of two, and a first line only loose forgives
    both = "The Aare flows through Bern \U0001F30A. It is clean and cold \U0001F686."
    assert _scores(aare, both) == (1.0, 1.0, [True, True], 0.0)
    padded = [{"N": None, "min_words": 5, "max_words": 12}, {"N": None, "min_words": None, "max_words": None}]
    assert _scores({**aare, "kwargs": padded}, both) == (1.0, 1.0, [True, True], 0.0)  # the hub's rows: every key
    assert _scores(aare, "The Aare flows through Bern. It is clean and cold.") == (0.0, 0.0, [True, False], 0.0)
    assert _scores(aare, "Sure, here is a short description of the river for you:\n" + both) == (
        0.0, 1.0, [False, True], 0.0)
    # format:no_whitespace; an unclosed thinking span leaves no answer, which follows nothing
    assert _scores(ticket, "BERN-ZUE-2ND-CLASS")[:2] == (1.0, 1.0)
    assert _scores(ticket, "BERN ZUE 2ND CLASS")[:2] == (0.0, 0.0)
    assert _scores(ticket, "<think>BERN-ZUE")[:2] == (0.0, 0.0)
    assert utils.agg_inst_level_acc([[True, False], [True]]) == pytest.approx(2 / 3)


def test_a_checker_that_cannot_parse_an_answer_costs_that_answer_only(docs: dict[int, dict]) -> None:
    """format:emoji indexes each sentence's last character: a sentence of punctuation alone makes it raise;
    the instruction counts as not followed and the prompt is flagged in checker_error."""
    strict, loose, inst, error = _scores(docs[1002], "The Aare flows through Bern \U0001F30A. !!! Yes \U0001F686.")
    assert (strict, loose, inst, error) == (0.0, 0.0, [True, False], 1.0)


def test_a_checker_without_its_nltk_data_names_the_item_the_instruction_and_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # an nltk data folder without punkt_tab
    doc = {"key": 7, "prompt": "Answer starting with a verb.", "instruction_id_list": ["words:start_verb"],
           "kwargs": [{}]}
    with pytest.raises(utils.IFBenchDataError, match=r"item 7: instruction 'words:start_verb' needs nltk data .*"
                                                     r"punkt_tab.*python -m nltk.downloader punkt_tab"):
        utils.process_results(doc, ["Go to Bern."])


def test_a_malformed_item_names_the_item() -> None:
    doc = {"key": 9, "prompt": "p", "instruction_id_list": ["format:no_such_check"], "kwargs": [{}]}
    with pytest.raises(ValueError, match=r"item 9: unknown instruction ids \['format:no_such_check'\]"):
        utils.process_results(doc, ["x"])
    with pytest.raises(ValueError, match="item 9: 1 instructions but 2 kwargs entries"):
        utils.process_results({**doc, "instruction_id_list": ["format:no_whitespace"], "kwargs": [{}, {}]}, ["x"])
    with pytest.raises(ValueError, match=r"item 9: instruction 'count:numbers' takes no arguments \['min_words'\]"):
        utils.process_results({**doc, "instruction_id_list": ["count:numbers"], "kwargs": [{"min_words": 3}]}, ["x"])
