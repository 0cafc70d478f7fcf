"""``apertus eval report``: the catalogue of the report's benchmarks, the written tables and picture,
the checks against the server, and a resumed run end to end against the served checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import SERVED_NAME

from apertus_plugins.testing.serve import VLLMServer
from eval_tasks.catalogue import SUITES, by_id, load, suite
from eval_tasks.report.render import benchmark_table, counts

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "evaluation.md"


# ------------------------------------------------------------------ the catalogue

def test_the_catalogue_lists_every_benchmark_of_the_reports_tables() -> None:
    """Tables L.1 and L.2 (65 rows, with IFBench of Tables 23/25), machine translation (Tables 31-32), the 34 rows of Table 34, the 17 of
    Table 35 and RULER and HELMET of Table 36; each runnable one has an Apertus task, each other a reason."""
    items = load()
    listed = lambda *p: [b for b in items if b.listed.startswith(p)]  # noqa: E731
    assert len(listed("L.1")) == 34 and len(listed("L.2")) == 31 and len(listed("Tables 23")) == 1
    assert len(listed("Tables 31 and 32")) == 2  # machine translation
    assert len(listed("Table 34")) == 34 and len(listed("Table 35")) == 17
    assert {b.id for b in listed("Table 36")} == {"ruler", "ruler_niah_single_1", "helmet"}
    for b in items:
        assert b.runnable != bool(b.absent), b.id
        if b.runnable:
            assert b.tasks and all(t.startswith("apertus_") for t in b.tasks.values()), b.id
        assert all(ref.value >= 0 and ref.table and ref.row and ref.column
                   for row in b.rows for ref in row.reference.values()), b.id
    c = counts()
    assert c["report benchmarks"] == c["with an Apertus task"] + c["absent"] == len(items) - 1  # NIAH: a part of RULER
    assert c == {"report benchmarks": 121, "with an Apertus task": 95, "absent": 26}
    # the numbers of the released 8B, cited by table, row and column (each checked against the report)
    refs = {b.id: {m: r.value for m, r in b.rows[0].reference.items()} for b in items}
    assert refs["math500"] == {"off": 50.2, "think": 71.4} and refs["aime24"] == {"off": 13.3, "think": 22.9}
    assert refs["charter_alignment"] == {"off": 66.7} and refs["ai2d"] == {"off": 74.3, "think": 76.8}
    assert refs["tedlium_long_form"] == {"off": 36.0} and by_id()["ruler"].rows[-1].reference["off"].value == 50.5
    assert by_id()["math500"].rows[0].reference["think"].cite() == "Table 25, MATH-500, 8B On"
    for name in SUITES:
        assert suite(name), name


#: the benchmarks of the report without an Apertus task whose reason is "the installed harness has none",
#: each with the pattern its task would carry in a harness's registry
NOT_IN_THE_HARNESSES = {
    "multi_ifeval": "multi_?if", "hallulens_precisewiki": "hallulens",
    "hallulens_longwiki": "hallulens", "hallulens_nonsensical": "hallulens", "harmbench": "harmbench",
    "arena_hard_v01": "arena_?hard", "arena_hard_v2": "arena_?hard",
    "polyglotoxicity": "polyglo", "aya_redteaming": "aya_?red", "realguardrails_sifeval": "guardrail",
    "realguardrails_tensortrust": "tensor_?trust|guardrail", "realguardrails_srules": "s_?rules|guardrail",
    "swissgov": "swiss_?gov", "helmet": "helmet", "frieda": "frieda", "geobench": "geobench",
    "vrsbench": "vrsbench", "pathvqa": "path_?vqa", "pmc_vqa": "pmc_?vqa", "mm_safety": "mm_?safety",
}


def test_a_benchmark_without_a_task_names_the_harnesses_checked_and_they_lack_it() -> None:
    """Each missing benchmark's row names the installed harness versions it was checked against, and those
    registries indeed have no task for it (a harness upgrade that adds one fails here: wire it); the
    benchmarks they have are wired (V*Bench, MathVista with the named judge), VQA-RAD and WMT24++ by this package's tasks."""
    import re
    from importlib.metadata import version

    from lm_eval.tasks import TaskManager as LmTasks
    from lmms_eval.tasks import TaskManager as LmmsTasks

    registry = set(LmTasks().all_tasks) | set(LmmsTasks().all_tasks)
    checked = {"lm_eval": f"lm-eval {version('lm_eval')}", "lmms_eval": f"lmms-eval {version('lmms_eval')}"}
    items = by_id()
    for bid, pattern in NOT_IN_THE_HARNESSES.items():
        b = items[bid]
        assert b.absent, bid
        image = b.listed.startswith("Table 34")
        assert checked["lmms_eval"] in b.absent and (image or checked["lm_eval"] in b.absent), (bid, b.absent)
        found = sorted(t for t in registry if re.search(pattern, t, re.IGNORECASE))
        assert not found, f"{bid}: the installed harnesses now have {found}: wire it"
    assert items["vstar"].upstream in registry and items["mathvista"].upstream in registry
    # VQA-RAD is this package's own lmms-eval task, because the installed lmms-eval still has none
    assert items["vqa_rad"].template and not [t for t in registry if re.search("vqa_?rad", t, re.IGNORECASE)]
    # WMT24++ (news) likewise: this package's lm-eval task, because the installed harnesses have none
    assert items["wmt24pp"].template and not [t for t in registry if re.search("wmt_?24", t, re.IGNORECASE)]
    assert items["mathvista"].need("judge") is not None and items["mathvista"].report_judge


#: Rows that also name lighteval as checked, beyond those above: the benchmark and its task-name pattern
LIGHTEVAL_LACKS = {"include45": "include_?45", "mlogiqa": "mlogiqa", "blend": "blend", "culturalbench": "cultural_?bench"}


def test_the_rows_that_name_lighteval_are_right_that_it_lacks_them() -> None:
    """lighteval (installed for IFBench's checkers) is named as checked in a missing benchmark's row only
    where none of its task configurations (every ``name=`` of its task modules) is that benchmark."""
    import re
    from importlib.metadata import version
    from importlib.util import find_spec

    tasks_dir = Path(find_spec("lighteval.tasks").submodule_search_locations[0])
    names = {m.group(1) for f in tasks_dir.rglob("*.py")
             for m in re.finditer(r"""\bname\s*=\s*(?:f?["'])([^"'{]+)""", f.read_text(encoding="utf-8"))}
    assert {"ifbench_test", "squad_v2"} <= names, "lighteval's task names were not read"
    checked = f"lighteval {version('lighteval')}"
    items = by_id()
    rows = {**{b: p for b, p in NOT_IN_THE_HARNESSES.items() if "lighteval" in items[b].absent}, **LIGHTEVAL_LACKS}
    assert len(rows) >= 15
    for bid, pattern in rows.items():
        assert checked in items[bid].absent, (bid, items[bid].absent)
        found = sorted(n for n in names if re.search(pattern, n, re.IGNORECASE))
        assert not found, f"{bid}: lighteval has {found}: wire it or say why not"


def test_the_documentation_lists_the_catalogue() -> None:
    """docs/evaluation.md holds the table `apertus eval benchmarks --markdown` prints (one source)."""
    text = DOCS.read_text(encoding="utf-8")
    assert benchmark_table() in text, "regenerate the table in docs/evaluation.md with `apertus eval benchmarks --markdown`"


def test_plan_errors_name_what_to_change() -> None:
    from eval_tasks.report.runner import ReportError, plan

    with pytest.raises(ReportError, match="unknown suite 'texts'"):
        plan("texts")
    with pytest.raises(ReportError, match="unknown benchmark.*nope.*apertus eval benchmarks"):
        plan("smoke", ["nope"])
    with pytest.raises(ReportError, match="no Apertus task for helmet .*own harness"):
        plan("long-context", ["helmet"])
    items = plan("thinking", ["aime24", "math500"])
    assert [(i.task, i.mode) for i in items] == [("apertus_minerva_math500_think", "think"),
                                                 ("apertus_aime24_think", "think")]
    assert {i.mode for i in plan("image")} == {"off", "think"}


def test_a_judged_benchmark_without_a_judge_is_skipped_naming_the_settings_and_the_reports_judge(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MathVista needs the judge the user names (URL and model, no charter); the charter alignment also
    its charter; the skip reason names what to set and the judge the report used. The other image tasks
    need nothing of the kind and run."""
    from types import SimpleNamespace

    from eval_tasks.report.runner import Options, needs, plan

    for var in ("APERTUS_EVAL_JUDGE_URL", "APERTUS_EVAL_JUDGE_MODEL", "APERTUS_EVAL_CHARTER"):
        monkeypatch.delenv(var, raising=False)
    opts = Options(suite="image", base_url="http://127.0.0.1:9/v1", output=tmp_path)
    served = SimpleNamespace(name="m", max_model_len=None)
    items = plan("image", ["mathvista", "vstar", "chartqa"])
    problems = needs(items, opts, served, client=None)
    assert set(problems) == {"apertus_mathvista_testmini", "apertus_mathvista_testmini_think"}
    reason = problems["apertus_mathvista_testmini"][0]
    assert reason.startswith("needs a judge: set APERTUS_EVAL_JUDGE_URL, APERTUS_EVAL_JUDGE_MODEL (the report's judge: "
                             "none named"), reason
    charter = plan("post-trained-text", ["charter_alignment"])
    opts = Options(suite="post-trained-text", base_url="http://127.0.0.1:9/v1", output=tmp_path, max_new_tokens=64)
    assert needs(charter, opts, served, client=None)["apertus_charter_alignment"][0].startswith(
        "needs a judge: set APERTUS_EVAL_JUDGE_URL, APERTUS_EVAL_JUDGE_MODEL, APERTUS_EVAL_CHARTER")
    alpaca = plan("post-trained-text", ["alpacaeval2"])
    assert needs(alpaca, opts, served, client=None)["apertus_alpacaeval2"] == [
        "needs a judge: set APERTUS_EVAL_JUDGE_URL, APERTUS_EVAL_JUDGE_MODEL (the report's judge: GPT-4.1 against "
        "AlpacaEval's GPT-4 reference outputs; ours is the judge the user names (any OpenAI-compatible judge that "
        "returns log-probabilities) against the same reference outputs)"]
    # a named judge that does not answer: every judged task says so, the others run
    from apertus_plugins.testing.serve import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setenv("APERTUS_EVAL_JUDGE_URL", url)
    monkeypatch.setenv("APERTUS_EVAL_JUDGE_MODEL", "judge")
    problems = needs(items, opts, served, client=None)
    assert set(problems) == {"apertus_mathvista_testmini", "apertus_mathvista_testmini_think"}
    unreachable = f"the judge given by APERTUS_EVAL_JUDGE_URL={url} (APERTUS_EVAL_JUDGE_MODEL=judge) cannot be used: "
    assert problems["apertus_mathvista_testmini"][0].startswith(unreachable) and "unreachable" in \
        problems["apertus_mathvista_testmini"][0]
    assert needs(alpaca, opts, served, client=None)["apertus_alpacaeval2"][0].startswith(unreachable)
    reasons = needs(charter, opts, served, client=None)["apertus_charter_alignment"]
    assert reasons[0].startswith("needs a judge: set APERTUS_EVAL_CHARTER") and reasons[1].startswith(unreachable)


# ------------------------------------------------------------------ against the served checkpoint

def _report(server: VLLMServer, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "apertus_plugins.cli", "eval", "report", "--base-url", server.base_url,
            "--output", str(out), *extra]


def test_unmet_needs_stop_the_run_at_the_start(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """The served context (4096) and audio limit (60 s, the processor's default) against what the tasks
    need: one message lists every task that cannot run and the server option to change."""
    proc = subprocess.run(_report(vllm_server, tmp_path / "a", "--suite", "smoke", "--limit", "1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "cannot run against" in err and "(apertus-tiny, context 4096)" in err
    assert ("apertus_minerva_math500: the protocol's budget of 16384 new tokens does not fit the served context of "
            "4096") in err
    assert "--max-new-tokens" in err and "--max-model-len" in err
    assert "apertus_niah_single_1: needs the model's tokenizer: --tokenizer" in err
    assert "RULER at 262144 tokens needs a served context of at least 262272" in err
    assert not (tmp_path / "a" / "runs").exists()  # nothing ran
    proc = subprocess.run(_report(vllm_server, tmp_path / "b", "--suite", "audio", "--benchmarks", "tedlium_long_form",
                                  "--limit", "1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # the server's own limits, learnt by probing /tokenize with a silent clip as long as TED-LIUM's longest
    # talk: vLLM decodes up to 600 s, then the Apertus processor takes up to 60 s
    assert ("apertus_tedlium_long_form: clips of up to 1320 s; the server's vLLM decodes 600 s: start the server "
            "with VLLM_MAX_AUDIO_DECODE_DURATION_S=1320 in its environment, and --mm-processor-kwargs "
            "'{\"max_audio_seconds\": 1320}'") in proc.stderr
    assert "take about 56896 tokens; the server serves 4096: serve with --max-model-len" in proc.stderr
    from apertus_plugins.infra.client import Client
    from eval_tasks.report.server import audio_probe

    with Client(vllm_server.base_url) as client:
        assert audio_probe(client, vllm_server.url(""), SERVED_NAME, 5) is None
        assert audio_probe(client, vllm_server.url(""), SERVED_NAME, 70).startswith(
            "clips of up to 70 s; the server accepts 60 s: serve with --mm-processor-kwargs")


def test_alpacaeval2_with_an_unreachable_judge_is_skipped_with_its_reason(vllm_server: VLLMServer, data_env: Path,
                                                                         tmp_path: Path) -> None:
    """`--skip-unmet`: AlpacaEval 2 against a named judge that does not answer is a skipped row naming the
    judge and why, beside the report's number; nothing runs."""
    from apertus_plugins.testing.serve import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    env = {**os.environ, "APERTUS_EVAL_JUDGE_URL": url, "APERTUS_EVAL_JUDGE_MODEL": "judge"}
    out = tmp_path / "alpaca"
    done = subprocess.run(_report(vllm_server, out, "--suite", "post-trained-text", "--benchmarks", "alpacaeval2",
                                  "--max-new-tokens", "12", "--skip-unmet", "--no-progress"),
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (row,) = json.loads((out / "report.json").read_text(encoding="utf-8"))["rows"]
    assert row["task"] == "apertus_alpacaeval2" and row["ours"] is None and row["reference"]["value"] == 42.7, row
    assert row["status"].startswith(f"skipped: the judge given by APERTUS_EVAL_JUDGE_URL={url} "
                                    "(APERTUS_EVAL_JUDGE_MODEL=judge) cannot be used: ") and "unreachable" in row["status"]
    assert not (out / "runs").exists()


def _workers(out: Path) -> list[int]:
    """The worker processes of the run writing into ``out`` (their plan file is there)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "eval_tasks.report.worker" in cmd and str(out) in cmd:
            found.append(int(proc.name))
    return found


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert proc.poll() is None, "the run ended before its first task finished"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.2)


def test_report_runs_the_smoke_suite_resumes_after_a_kill_and_writes_tables_and_picture(
        vllm_server: VLLMServer, tiny_model_dir: Path, data_env: Path, tmp_path: Path) -> None:
    """`apertus eval report --suite smoke --limit 2` against the served tiny checkpoint with local data:
    killed once its first task finished, the same command resumes without running that task again and
    writes report.md (our numbers beside the report's) and report.svg (bars per benchmark)."""
    out = tmp_path / "report"
    cmd = _report(vllm_server, out, "--suite", "smoke", "--limit", "2", "--tokenizer", str(tiny_model_dir),
                  "--lengths", "1024", "--max-new-tokens", "12")
    first = out / "runs" / "apertus_truthfulqa_mc2" / "result.json"  # the suite's first task (log-likelihood)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(first, proc, timeout=600)
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its worker die at once, mid-suite
    finally:
        proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while _workers(out):  # the run's worker (its own session, so not in the killed group) follows it out
        assert time.monotonic() < deadline, "the worker outlived the killed run"
        time.sleep(0.5)
    stamp = first.stat().st_mtime_ns
    assert not (out / "report.md").exists()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert first.stat().st_mtime_ns == stamp  # the finished task was not run again
    log = (out / "lm_eval.log").read_text(encoding="utf-8", errors="replace")
    assert "apertus_minerva_math500" in log
    assert "apertus eval report smoke" in done.stderr  # the progress bar
    assert Path(done.stdout.strip()) == out / "report.md"

    report = (out / "report.md").read_text(encoding="utf-8")
    rows = json.loads((out / "report.json").read_text(encoding="utf-8"))["rows"]
    ran = {r["task"]: r for r in rows if r["task"]}
    assert set(ran) == {"apertus_truthfulqa_mc2", "apertus_minerva_math500", "apertus_niah_single_1", "apertus_ai2d",
                        "apertus_librispeech_test_clean"}
    for row in (r for r in rows if r["task"]):
        if row["benchmark"] == "ruler_niah_single_1" and not row["label"].endswith(" 1k"):
            assert row["status"].startswith("not run at this length"), row  # the report's lengths, not run here
        else:
            assert row["status"] == "ok" and row["ours"] is not None, row
    by_task = {r["task"]: r for r in rows if r["task"] and r["status"] == "ok"}
    assert by_task["apertus_truthfulqa_mc2"]["reference"]["value"] == 56.1
    assert by_task["apertus_minerva_math500"]["reference"] == {"value": 50.2, "table": "L.3", "row": "MATH-500",
                                                               "column": "8B +SDPO", "unlike": None}
    assert by_task["apertus_minerva_math500"]["protocol"] == "Math Verify; 4 shots; thinking off"
    page = (out / "report.html").read_text(encoding="utf-8")
    assert 'data-benchmark="math500"' in page and "Table L.3, MATH-500, 8B +SDPO: Math Verify; 4 shots" in page
    summary = (out / "report.txt").read_text(encoding="utf-8")
    assert "MATH-500 (Minerva)" in summary and "\x1b[" not in summary and "Text, thinking off" in done.stderr
    assert by_task["apertus_ai2d"]["metric"] == "exact_match,flexible-extract"
    assert by_task["apertus_librispeech_test_clean"]["ours"] >= 0  # WER in percent, as the harness reports it
    for title in ("## Text, thinking off", "## Images, thinking off", "## Audio (Table 35)", "## Long context"):
        assert title in report
    math = next(line for line in report.splitlines() if line.startswith("| MATH-500 (Minerva) |"))
    cells = [c.strip() for c in math.strip("|").split("|")]
    ours = by_task["apertus_minerva_math500"]["ours"]
    assert cells[1:6] == [f"{ours:.1f}", "50.2", f"{ours - 50.2:+.1f}", "`apertus_minerva_math500`", "`math_verify,none`"]
    assert "Table L.3, MATH-500, 8B +SDPO" in math and "limit: 2 items per task" in report
    assert f"{SERVED_NAME} at {vllm_server.base_url}" in report

    svg = ET.parse(out / "report.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    bars = {(r.get("class"), r.findtext(f"{ns}title").split(":")[0]) for r in svg.iter(f"{ns}rect") if r.get("class")}
    assert {c for c, _ in bars} == {"ours", "report"}
    labels = [t.text for t in svg.iter(f"{ns}text")]
    for name in ("TruthfulQA (MC2)", "MATH-500 (Minerva)", "NIAH single 1 1k", "AI2D", "LibriSpeech test-clean ↓"):
        assert name in labels, name
    ours_bars = [r for r in svg.iter(f"{ns}rect") if r.get("class") == "ours"]
    assert len(ours_bars) == sum(1 for r in rows if r["ours"] is not None)


def test_the_base_suite_runs_a_post_trained_benchmark_without_the_chat_template(
        vllm_server: VLLMServer, tiny_model_dir: Path, data_env: Path, tmp_path: Path) -> None:
    """`--suite base` runs TruthfulQA's base-model variant (Table 15's row): upstream's prompt through
    the completions API, no chat template, compared with the base model's number; and SQuAD v2's, this
    package's task generating its answer line the same way."""
    out = tmp_path / "base"
    done = subprocess.run(_report(vllm_server, out, "--suite", "base", "--benchmarks", "truthfulqa_mc2,squad_v2",
                                  "--limit", "2", "--tokenizer", str(tiny_model_dir), "--no-progress"),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = {r["task"]: r for r in json.loads((out / "report.json").read_text(encoding="utf-8"))["rows"]}
    squad = rows.pop("apertus_squad_v2_base")
    assert squad["status"] == "ok" and 0.0 <= squad["ours"] <= 100.0 and squad["reference"]["value"] == 17.6, squad
    squad_sample = json.loads((out / "runs" / squad["task"] / "samples.jsonl").read_text(encoding="utf-8").splitlines()[0])
    squad_context = json.dumps(squad_sample.get("arguments"))
    assert "Answer:" in squad_context and "<|" not in squad_context, squad_context[:500]  # no chat markers
    (row,) = rows.values()
    assert row["task"] == "apertus_truthfulqa_mc2_base" and row["status"] == "ok" and row["ours"] is not None, row
    assert row["reference"]["value"] == 49.0 and row["cited"] == "Table 15, TruthfulQA, Apertus 1.5 8B: Accuracy; 0 shots; base model"
    sample = json.loads((out / "runs" / row["task"] / "samples.jsonl").read_text(encoding="utf-8").splitlines()[0])
    context = json.dumps(sample.get("arguments"))
    assert "Q:" in context and "<|" not in context, context[:500]  # upstream's prompt, no chat markers
    assert "Base model (Tables 13-22): 2 compared" in done.stderr  # the terminal summary
