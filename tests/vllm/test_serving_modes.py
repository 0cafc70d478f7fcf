"""The plugin's model served as deployments run it: speculative decoding and several API server processes.

Each mode starts its own server (one start per mode, stopped at the end of its test, so at most two
servers live at once beside the suite's). Speculation must not change a greedy token: every mode's
tokens are compared with those of the suite's plain server for the same prompts.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
from pathlib import Path

import pytest
from conftest import server_args

from apertus_plugins.infra.client import http_json
from apertus_plugins.testing.serve import VLLMServer

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
NUM_SPECULATIVE = 3


def prompts(image_part: dict) -> list[list[dict]]:
    return [
        [{"role": "user", "content": "Count: one two three one two three one two three one two"}],
        [{"role": "user", "content": "Hello, who are you?"}],
        [{"role": "user", "content": [image_part, {"type": "text", "text": "Describe the picture."}]}],
    ]


def greedy(server: VLLMServer, messages: list[dict], max_tokens: int = MAX_TOKENS) -> list[int]:
    payload = {"model": "apertus", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True}
    status, body = http_json(server.url("/v1/chat/completions"), payload, timeout=600)
    assert status == 200, body
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == max_tokens, body
    return ids


@pytest.fixture(scope="module")
def reference(server, image_part) -> list[list[int]]:
    """The greedy tokens of the suite's plain server (no speculation, one API server)."""
    return [greedy(server, m) for m in prompts(image_part)]


def counter(metrics: str, name: str) -> float:
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", metrics, flags=re.M)
    assert found, f"{name} not in /metrics"
    return sum(float(v) for v in found)


def speculative_server(checkpoint: Path, config: dict, log: Path) -> VLLMServer:
    args = [*server_args(), "--speculative-config", json.dumps(config)]
    return VLLMServer(checkpoint, args=args, log_path=log, startup_timeout=900)


def check_speculation(srv: VLLMServer, reference: list[list[int]], image_part: dict) -> None:
    assert [greedy(srv, m) for m in prompts(image_part)] == reference, srv.log_tail()
    status, metrics = http_json(srv.url("/metrics"), timeout=60)
    assert status == 200
    # speculation ran: tokens were proposed (and the verifier kept the greedy ones only)
    assert counter(metrics, "vllm:spec_decode_num_draft_tokens_total") > 0, srv.log_tail()


def test_ngram_speculation_gives_the_greedy_tokens_of_the_plain_server(checkpoint, reference, image_part,
                                                                        tmp_path_factory):
    config = {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE,
              "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    log = tmp_path_factory.mktemp("logs") / "vllm-ngram.log"
    with speculative_server(checkpoint, config, log) as srv:
        check_speculation(srv, reference, image_part)


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory) -> Path:
    """A smaller checkpoint with the same vocabulary and other weights: one layer, another seed."""
    from dataclasses import replace

    from apertus_plugins.testing.checkpoint import SIZES, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("draft") / "apertus-draft",
                            size=replace(SIZES["tiny"], num_hidden_layers=1), seed=1, init="varied")


def test_a_draft_model_gives_the_greedy_tokens_of_the_plain_server(checkpoint, draft_checkpoint, reference,
                                                                   image_part, tmp_path_factory):
    config = {"model": str(draft_checkpoint), "num_speculative_tokens": NUM_SPECULATIVE}
    log = tmp_path_factory.mktemp("logs") / "vllm-draft.log"
    with speculative_server(checkpoint, config, log) as srv:
        check_speculation(srv, reference, image_part)


def group_rss(srv: VLLMServer) -> dict[str, int]:
    """Resident memory (bytes) of each process of the server's group, by process title."""
    import psutil

    assert srv.proc is not None
    rss: dict[str, int] = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if p.pid != srv.proc.pid and os.getpgid(p.pid) != srv.proc.pid:
                continue
            title = " ".join(p.info["cmdline"] or []) or p.info["name"]
            rss[f"{p.pid} {title[:60]}"] = p.memory_info().rss
        except (psutil.Error, ProcessLookupError):
            continue
    return rss


def test_two_api_server_processes_answer_text_and_image_requests(checkpoint, reference, image_part, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "vllm-api2.log"
    # `vllm serve` (the module entry point ignores --api-server-count); requests logged with their process id
    args = [*server_args(one_process=False), "--api-server-count", "2", "--enable-log-requests"]
    with VLLMServer(checkpoint, args=args, log_path=log, startup_timeout=900, cli=True) as srv:
        conversations = prompts(image_part)
        # the first round checks the tokens; later rounds reach the other process (the kernel spreads connections)
        assert [greedy(srv, m) for m in conversations] == reference, srv.log_tail()
        pids: set[str] = set()
        for _ in range(6):
            with cf.ThreadPoolExecutor(4) as pool:
                for ids in pool.map(lambda m: greedy(srv, m, 2), conversations * 2):
                    assert len(ids) == 2
            pids = set(re.findall(r"pid=(\d+)\) INFO [^\n]*Added request chatcmpl", log.read_text(errors="replace")))
            if len(pids) >= 2:
                break
        assert len(pids) == 2, f"chat requests answered by API server processes {sorted(pids)} only"
        rss = group_rss(srv)
        print("\nRSS per process (MiB):\n" + "\n".join(f"  {v / 2**20:8.0f}  {k}" for k, v in sorted(rss.items())))
