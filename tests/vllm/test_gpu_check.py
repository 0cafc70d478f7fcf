"""The prepared GPU serving check (``benchmarks/gpu/vllm_serve.py``), run on CPU against the suite's servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "vllm_serve.py"


def run_script(server, checkpoint, tmp_path, *extra):
    out = tmp_path / "vllm_serve.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-test", "--url", server.url(""), "--checkpoint",
                           str(checkpoint), "--out", str(out), *extra], capture_output=True, text=True, timeout=900)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_every_request_of_the_gpu_check_passes_on_the_suite_server(server, checkpoint, tmp_path):
    proc, report = run_script(server, checkpoint, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = report["results"]
    assert list(results) == ["text", "image", "audio", "tool_call", "thinking", "throughput"]
    assert all(r["ok"] for r in results.values()) and report["ok"]
    assert results["tool_call"]["calls"] == [{"name": "get_weather", "arguments": {"city": "Bern"}}]
    assert results["thinking"]["reasoning"] == "The user asks for the weather."
    assert results["image"]["image_codes"] > 0 and results["audio"]["audio_codes"] > 0
    assert results["throughput"]["tokens"] == 4 * 8 and results["throughput"]["tokens_per_s"] > 0
    assert all(results[k]["seconds"] > 0 for k in ("text", "image", "audio", "tool_call", "thinking"))


def test_a_server_without_the_parsers_and_in_the_training_layout_fails_the_check(training_server, checkpoint,
                                                                                tmp_path):
    proc, report = run_script(training_server, checkpoint, tmp_path, "--concurrency", "0")
    assert proc.returncode == 1
    failed = sorted(k for k, r in report["results"].items() if not r["ok"])
    assert failed == ["image", "thinking", "tool_call"], report
    assert "FAILED: image, tool_call, thinking" in proc.stdout
    assert "prompt ids" in report["results"]["image"]["error"]  # the training layout differs from the core's default


def test_url_without_checkpoint_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--url", "http://127.0.0.1:9"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--url needs --checkpoint" in proc.stderr
