"""``apertus prefs``: a response pool scored by a real judge (the suite's vLLM server), MaxMin pairs, resume.

The judge is the tiny random Apertus checkpoint served by vLLM through the plugin (tests/verl/conftest.py):
its ratings are noise, so the tests check the protocol, the arithmetic (every score recomputed from the
judge's kept log-probabilities), the pairing rule and the bookkeeping, not the judgement.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apertus_plugins.posttrain.prefs import (
    ASPECTS,
    RUBRICS,
    Journal,
    judgement_key,
    maxmin,
    read_pool,
    render_prompt,
)

ROOT = Path(__file__).resolve().parents[2]


def pool(n: int, responses: int = 3) -> list[dict]:
    rows = []
    for k in range(n):
        rows.append({"id": f"p{k}", "prompt": f"Question {k}: name a colour.",
                     "responses": [{"model": f"model-{j}", "response": f"Answer {j} to {k}: " + "blue " * (1 + j)}
                                   for j in range(responses)]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def prefs(pool_path: Path, out: Path, judge_server, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "apertus_plugins.cli", "prefs", str(pool_path), str(out),
           "--judge-url", judge_server.url, "--judge-model", judge_server.model,
           "--top-logprobs", str(judge_server.top_logprobs), "--no-progress", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def journal_lines(out: Path) -> list[dict]:
    path = out / "judgements.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


# ------------------------------------------------------------------------------------------ no server
def test_read_pool_layouts_and_errors(tmp_path):
    rows = [{"id": "a", "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
             "responses": ["Hello", {"source_model": "m2", "text": "Hi there"}, {"model": "m3", "completion": ""}]},
            {"prompt": "Second", "responses": [{"model": "x", "content": "ok"}]}]
    items = read_pool(write_jsonl(tmp_path / "pool.jsonl", rows))
    assert [i.id for i in items] == ["a", "1"]  # a record without id: its position
    assert [(r.model, r.text) for r in items[0].responses] == [("", "Hello"), ("m2", "Hi there"), ("m3", "")]
    assert items[1].prompt == ({"role": "user", "content": "Second"},)
    assert render_prompt(items[0].prompt) == "Hi" and render_prompt(items[1].prompt) == "Second"
    assert read_pool(tmp_path / "pool.jsonl", limit=1)[0].id == "a"
    renamed = [{"qid": 7, "question": "Q", "completions": ["A", "B"]}]
    got = read_pool(write_jsonl(tmp_path / "renamed.jsonl", renamed), prompt_field="question",
                    responses_field="completions", id_field="qid")
    assert got[0].id == "7" and [r.text for r in got[0].responses] == ["A", "B"]
    for bad, message in [('{"prompt": "x"}', r"bad.jsonl:1: missing 'responses'"),
                         ('{"prompt": "x", "responses": "y"}', r"'responses' must be a list"),
                         ('{"prompt": 3, "responses": []}', r"'prompt' must be text or a non-empty list"),
                         ('{"prompt": "x", "responses": [{"model": "m"}]}', r"response 0: a response object needs"),
                         ('{"id": 1, "prompt": "x", "responses": []}\n{"id": 1, "prompt": "y", "responses": []}',
                          r"bad.jsonl:2: id '1' is also the id of .*bad.jsonl:1"),
                         ("{nope", r"bad.jsonl:1: not JSON")]:
        (tmp_path / "bad.jsonl").write_text(bad + "\n")
        with pytest.raises(ValueError, match=message):
            read_pool(tmp_path / "bad.jsonl")


def test_maxmin_rule_ties_and_the_rubrics():
    assert maxmin([3.0, 4.5, 1.2, 4.5, 1.2]) == (1, 2)  # the earlier of equal scores on both ends
    assert maxmin([2.0, 2.0]) is None and maxmin([4.0]) is None  # a tie or a single response: no preference
    assert maxmin([2.0, 2.4], min_margin=0.5) is None and maxmin([2.0, 2.6], min_margin=0.5) == (1, 0)
    with pytest.raises(ValueError, match="NaN"):
        maxmin([1.0, float("nan")])
    # the report's four aspects (section 4.6.1), each a 1..5 rubric with {prompt} and {response} to fill in
    assert list(ASPECTS) == ["truthfulness", "helpfulness", "honesty", "instruction_following"]
    for aspect, template in ASPECTS.items():
        assert template.count("{prompt}") == template.count("{response}") == 1
        assert RUBRICS[aspect] in template and all(f"\n{d} - " in template for d in "12345")
    # the online DPO pairs use the same rule
    from verl_ext import dpo

    assert dpo.maxmin_pairs(["a", "a", "a", "b", "b"], [3.0, 4.5, 1.2, 2.0, 2.0])[0] == [(1, 2)]


def test_journal_drops_the_line_a_killed_run_was_writing(tmp_path):
    path = tmp_path / "judgements.jsonl"
    path.write_text('{"key": "k1", "score": 3.5}\n{"key": "k2", "error": "boom"}\n{"key": "k3", "sco')
    j = Journal(path)
    assert set(j.records) == {"k1"} and set(j.failures) == {"k2"}
    j.append({"key": "k2", "score": 2.0})
    j.close()
    lines = path.read_text().splitlines()
    assert lines[-1] == '{"key": "k2", "score": 2.0}' and all(json.loads(x) for x in lines)
    again = Journal(path)
    assert set(again.records) == {"k1", "k2"} and not again.failures
    again.close()
    prompt = ({"role": "user", "content": "x"},)
    assert judgement_key("honesty", prompt, "r") == judgement_key("honesty", [dict(prompt[0])], "r")
    assert judgement_key("honesty", prompt, "r") != judgement_key("truthfulness", prompt, "r")


# ------------------------------------------------------------------------------------------ with the judge
def check_pairs(out: Path, rows: list[dict], aspects: list[str]) -> list[dict]:
    """Every score recomputed from the kept log-probabilities; each pair the MaxMin of the averaged scores."""
    scores = {}
    for rec in journal_lines(out):
        if "score" not in rec:
            continue
        mass = {int(t.strip()): math.exp(lp) for t, lp in rec["digit_logprobs"].items()}
        assert set(mass) <= {1, 2, 3, 4, 5} and mass
        want = sum(v * m for v, m in mass.items()) / sum(mass.values())
        assert rec["score"] == pytest.approx(want, rel=1e-9) and 1.0 <= rec["score"] <= 5.0
        assert "token" in rec and rec["judge_model"]  # the judge's own answer, kept (any token of its vocabulary)
        scores[rec["key"]] = rec["score"]
    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    by_id = {p["id"]: p for p in pairs}
    for row in rows:
        prompt = [{"role": "user", "content": row["prompt"]}]
        avg = []
        for r in row["responses"]:
            keys = [judgement_key(a, prompt, r["response"]) for a in aspects]
            avg.append(sum(scores[k] for k in keys) / len(keys) if all(k in scores for k in keys) else None)
        usable = [(i, s) for i, s in enumerate(avg) if s is not None]
        pick = maxmin([s for _, s in usable]) if len(usable) >= 2 else None
        if pick is None:
            assert row["id"] not in by_id
            continue
        p = by_id[row["id"]]
        best, worst = usable[pick[0]][0], usable[pick[1]][0]
        assert (p["chosen"], p["rejected"]) == (row["responses"][best]["response"], row["responses"][worst]["response"])
        assert p["chosen_model"] == row["responses"][best]["model"] and p["margin"] == pytest.approx(avg[best] - avg[worst])
        assert p["chosen_score"] == pytest.approx(avg[best]) and set(p["chosen_aspects"]) == set(aspects)
    return pairs


def test_prefs_kill_mid_run_resumes_without_rescoring(judge_server, tmp_path):
    rows = pool(8)
    pool_path = write_jsonl(tmp_path / "pool.jsonl", rows)
    out = tmp_path / "prefs"
    first = prefs(pool_path, out, judge_server, "--concurrency", "2")
    deadline = time.monotonic() + 600
    while len(journal_lines(out)) < 12 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "the run ended before it could be killed: " + first.communicate()[1][-2000:]
    os.kill(first.pid, signal.SIGKILL)
    first.communicate()
    before = journal_lines(out)
    total = 8 * 3 * len(ASPECTS)
    assert 12 <= len(before) < total and not (out / "pairs.jsonl").exists()
    second = prefs(pool_path, out, judge_server, "--concurrency", "4")
    _, err = second.communicate(timeout=900)
    assert second.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    done = [r for r in journal_lines(out) if "score" in r]
    # nothing judged twice: every judgement of the first run was reused, the second made only the rest
    assert len({r["key"] for r in done}) == len(done) == total
    assert summary["judgements_reused"] == len([r for r in before if "score" in r])
    assert summary["judgements_made"] == total - summary["judgements_reused"]
    assert summary["judgements"] == total and summary["judgements_failed"] == 0
    pairs = check_pairs(out, rows, list(ASPECTS))
    assert summary["pairs"] == len(pairs) == 8 - summary["prompts_tied"]
    # the output is what the offline DPO trainer reads
    from verl_ext import dpo

    assert len(dpo.load_pair_file(out / "pairs.jsonl")) == len(pairs)
    # a third run has nothing left to ask
    third = prefs(pool_path, out, judge_server)
    _, err = third.communicate(timeout=300)
    assert third.returncode == 0, err
    assert json.loads((out / "summary.json").read_text())["judgements_made"] == 0


def test_prefs_counts_ties_failures_and_too_few(judge_server, tmp_path):
    same = "The same answer."
    rows = [{"id": "tie", "prompt": "Say it.", "responses": [{"model": "a", "response": same},
                                                              {"model": "b", "response": same}]},
            # a response longer than the judge's context: its judgements fail (HTTP 400), the others pair
            {"id": "long", "prompt": "Talk.", "responses": [{"model": "a", "response": "yes " * 6000},
                                                             {"model": "b", "response": "Short."},
                                                             {"model": "c", "response": "Also short."}]},
            {"id": "alone", "prompt": "One.", "responses": [{"model": "a", "response": "Only me."},
                                                             {"model": "b", "response": ""}]}]
    pool_path = write_jsonl(tmp_path / "pool.jsonl", rows)
    out = tmp_path / "prefs"
    run = prefs(pool_path, out, judge_server, "--aspects", "helpfulness,honesty", "--concurrency", "3")
    _, err = run.communicate(timeout=900)
    assert run.returncode == 3, err[-2000:]  # some judgements failed: reported, the rest written
    assert "2 judgements failed" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["aspects"] == ["helpfulness", "honesty"]
    assert summary["judgements_failed"] == 2 and summary["responses_unscored"] == 1
    assert summary["prompts_tied"] == 1 and summary["prompts_too_few_scored"] == 1
    assert summary["empty_responses"] == 1 and summary["pairs"] == 1
    failed = [r for r in journal_lines(out) if "error" in r]
    assert len(failed) == 2 and all(r["id"] == "long" and r["model"] == "a" for r in failed)
    assert all("JudgeResponseError" in r["error"] for r in failed)
    # the identical responses were judged once (the journal is keyed by what was rated)
    assert sum(1 for r in journal_lines(out) if r["id"] == "tie") == 2
    (pair,) = check_pairs(out, rows, ["helpfulness", "honesty"])
    assert pair["id"] == "long" and {pair["chosen"], pair["rejected"]} == {"Short.", "Also short."}
    # a rerun retries the failures (and they fail again)
    rerun = prefs(pool_path, out, judge_server, "--aspects", "helpfulness,honesty")
    rerun.communicate(timeout=900)
    again = json.loads((out / "summary.json").read_text())
    assert again["judgements"] == 10 and again["judgements_reused"] == 8
    assert again["judgements_made"] == 0 and again["judgements_failed"] == 2


def test_prefs_bad_arguments_are_clear(judge_server, tmp_path):
    pool_path = write_jsonl(tmp_path / "pool.jsonl", pool(1))
    bad = prefs(pool_path, tmp_path / "o", judge_server, "--aspects", "helpfulness,style")
    _, err = bad.communicate(timeout=300)
    assert bad.returncode == 1 and "unknown aspects ['style']" in err
    down = subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "prefs", str(pool_path), str(tmp_path / "o"),
                           "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "judge", "--max-retries", "0",
                           "--timeout", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert down.returncode == 1 and "unreachable" in down.stderr and "run again to resume" in down.stderr
