"""WMT24++ news (Tables 31 and 32): the Apertus task reads the news items of English into German, French
and Italian (bad sources left out), asks for the translation only and scores corpus chrF per pair with
sacrebleu, the mean over the pairs as the row's number; the report has no number to compare with. (The
task runs end to end against the served checkpoint in test_lm_eval_tasks.py's lm-eval run.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import sacrebleu
import yaml

from eval_tasks.catalogue import by_id
from eval_tasks.derive import generation_kwargs, include_path
from eval_tasks.lm_eval.wmt24pp import utils
from eval_tasks.report import render
from eval_tasks.report.render import Line

REFS = ["Der Zug nach Bern fährt um Mittag ab.", "Die Berge sind hoch und der See ist kalt."]


def _items(pair: str, hyps: list[str], refs: list[str]) -> list[utils.Item]:
    return [utils.process_results({"lp": pair, "target": r}, [h])["chrf"] for h, r in zip(hyps, refs, strict=True)]


def test_the_row_runs_corpus_chrf_with_no_number_of_the_report() -> None:
    b = by_id()["wmt24pp"]
    assert b.runnable and b.tasks == {"off": "apertus_wmt24pp"} and not b.absent
    assert b.rows[0].metric == "chrf,none" and b.scale == 1 and list(b.suites) == ["post-trained-text"]
    assert b.kind_in("off") == "handwritten" and b.chat_in("off")
    assert b.rows[0].reference == {} and "no number in the text" in (b.note or "")
    # the report runner shows ours with the reason and no difference
    line = Line(b, b.rows[0].label, "off", "apertus_wmt24pp", "chrf,none", 55.0, "ok", None)
    assert line.delta is None and line.better is None and line.cited == "the report gives no number for this row"
    text = render.terminal([line], color=False) + render.markdown([line], {})
    assert "no number in the report" in text and "55.0" in text


def test_identical_unrelated_and_partial_translations_score_as_sacrebleu_does() -> None:
    pair = "en-de_DE"
    same = _items(pair, REFS, REFS)
    assert utils.chrf_of(same, pair) == pytest.approx(100.0)
    unrelated = ["xyzzy qwv", "plugh 123"]
    low = utils.chrf_of(_items(pair, unrelated, REFS), pair)
    assert low < 10.0
    partial = ["Der Zug nach Zürich fährt am Abend.", "Die Berge sind hoch."]
    mid = utils.chrf_of(_items(pair, partial, REFS), pair)
    assert low < mid < 100.0
    for hyps in (REFS, unrelated, partial):  # the corpus score, not a mean of sentence scores
        assert utils.chrf_of(_items(pair, hyps, REFS), pair) == pytest.approx(sacrebleu.corpus_chrf(hyps, [REFS]).score)
    sentence_mean = sum(sacrebleu.sentence_chrf(h, [r]).score for h, r in zip(partial, REFS, strict=True)) / 2
    assert mid != pytest.approx(sentence_mean)


def test_each_pair_is_scored_apart_and_the_row_is_their_mean() -> None:
    de = _items("en-de_DE", REFS, REFS)
    fr = _items("en-fr_FR", ["Le chat."], ["Le lac est froid."])
    items = de + fr
    assert utils.chrf_en_de_DE(items) == pytest.approx(100.0)
    assert utils.chrf_en_fr_FR(items) == pytest.approx(sacrebleu.corpus_chrf(["Le chat."], [["Le lac est froid."]]).score)
    assert math.isnan(utils.chrf_en_it_IT(items))  # no Italian items
    assert utils.chrf_mean(items) == pytest.approx((100.0 + utils.chrf_en_fr_FR(items)) / 2)
    assert math.isnan(utils.chrf_mean([]))


def test_the_reply_is_the_visible_translation_and_a_bad_pair_is_named() -> None:
    doc = {"lp": "en-it_IT", "source": "The mountains are high.", "target": "Le montagne sono alte."}
    s = utils.process_results(doc, ["<|inner_prefix|>hmm<|inner_suffix|>  Le montagne sono alte.\n"])
    assert s["chrf"] == ("en-it_IT", "Le montagne sono alte.", "Le montagne sono alte.") and s["degenerate"] == 0.0
    assert set(s) == {"chrf", "chrf_en_de_DE", "chrf_en_fr_FR", "chrf_en_it_IT", "degenerate"}
    prompt = utils.doc_to_text(doc)
    assert "from English into Italian" in prompt and "translation only" in prompt and prompt.endswith("\n\nItalian:")
    with pytest.raises(ValueError, match=r"apertus_wmt24pp: item language pair 'en-xx'"):
        utils.doc_to_text({"lp": "en-xx", "source": "a"})


def test_the_task_keeps_the_news_items_without_bad_sources(data_env: Path) -> None:
    from _fixtures import WMT24PP

    docs = list(utils.load()["test"])
    kept = [r for rows in WMT24PP.values() for r in rows if r["domain"] == "news" and not r["is_bad_source"]]
    assert [(d["lp"], d["source"], d["target"]) for d in docs] == [(r["lp"], r["source"], r["target"]) for r in kept]
    assert len(docs) == 3


def test_the_task_carries_the_protocols_chat_settings() -> None:
    task = yaml.safe_load((include_path("lm_eval") / "apertus_wmt24pp.yaml").read_text().replace("!function", ""))
    assert task["generation_kwargs"] == generation_kwargs("off") and task["task"] == "apertus_wmt24pp"
