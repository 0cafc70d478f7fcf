"""The code reward's sandbox: the report's code sources as they ship, hostile programs, many programs at once.

Programs run in the real local sandbox (bubblewrap + prlimit, tests/verl/debian.txt), through the ``code``
reward function and through verl's own reward manager. Each hostile program must be contained (its PID
namespace gone, nothing of it left running, the host untouched), scored 0 and reported with its verdict.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from apertus_plugins.plugins import registry
from apertus_plugins.posttrain.rewards import code_reward
from apertus_plugins.posttrain.sandbox import (
    BubblewrapSandbox,
    CodeRunner,
    Limits,
    SandboxUnavailable,
    judge_many,
    local_sandbox,
    parse_ground_truth,
)
from apertus_plugins.posttrain.sandbox.cases import lines_match, tokens_match
from apertus_plugins.testing.serve import free_port
from verl_ext.rewards import compute_score

SYSTEM_LINKS = {"bin", "sbin", "lib", "lib32", "lib64", "libx32"}
ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def fence(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def sandbox() -> BubblewrapSandbox:
    box = BubblewrapSandbox(limits=Limits(time_s=3, memory_mb=256), max_concurrent=4)
    box.check()
    return box


def namespace_alive(inode: int) -> bool:
    """Is any process of this PID namespace still running (zombies aside)?"""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "ns" / "pid") == f"pid:[{inode}]":
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    return True
        except OSError:
            continue
    return False


def assert_contained(run) -> None:
    inode = run.info["pid_namespace"]
    deadline = time.monotonic() + 10
    while namespace_alive(inode) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not namespace_alive(inode), f"processes of the sandbox's PID namespace {inode} outlived the run"


# ------------------------------------------------------------------------------------------ formats
def test_apps_taco_stdio_and_call_cases_as_they_ship():
    apps = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}
    ok = code_reward(ADD, apps)
    assert ok["score"] == 1.0 and ok["verdict"]["counts"] == {"passed": 2} and ok["verdict"]["backend"] == "bubblewrap"
    bad = code_reward(fence("a, b = map(int, input().split())\nprint(a - b)"), json.dumps(apps))
    assert bad["score"] == 0.0
    assert [c["verdict"] for c in bad["verdict"]["cases"]] == ["wrong_answer", "skipped"]
    assert "expected '3\\n'" in bad["verdict"]["cases"][0]["detail"]
    every = code_reward(fence("print(1 + 2)"), apps, stop_on_failure=False)
    assert [c["verdict"] for c in every["verdict"]["cases"]] == ["passed", "wrong_answer"]
    # TACO's raw row: the cases as JSON text in input_output; a LeetCode-style class with typing names unimported
    taco = {"input_output": json.dumps({"inputs": [[[3, 1, 2]], [[]]], "outputs": [[[1, 2, 3]], [[]]],
                                        "fn_name": "sortList"})}
    solution = "class Solution:\n    def sortList(self, xs: List[int]) -> List[int]:\n        print('debug')\n" \
               "        return tuple(sorted(xs))"
    assert code_reward(fence(solution), taco)["score"] == 1.0  # a tuple counts as a list; prints are not the result
    assert code_reward(fence("def sortList(xs):\n    return xs"), taco)["score"] == 0.0
    # verl's prime_code layout: arguments as JSON lines, the output as JSON text
    prime = {"inputs": ["[1, 2]\n3"], "outputs": ["[1, 2, 3]"], "fn_name": "append"}
    assert code_reward(fence("def append(xs, x):\n    return xs + [x]"), prime)["score"] == 1.0
    # the call harness finds no function: a runtime error naming it
    missing = code_reward(fence("def other(): pass"), prime)
    assert missing["verdict"]["cases"][0]["verdict"] == "runtime_error"
    assert "no function 'append'" in missing["verdict"]["cases"][0]["detail"]


def test_codecontests_and_codeforces_layouts_and_their_comparison():
    cc = {"public_tests": {"input": ["2\n"], "output": ["0.500000\n"]},
          "private_tests": {"input": ["3\n"], "output": ["0.333333"]},
          "generated_tests": {"input": ["4\n"], "output": ["0.25"]}}
    problem = parse_ground_truth(cc, data_source="deepmind/code_contests")
    assert (len(problem.cases), problem.compare, problem.source_format) == (3, "tokens", "codecontests")
    ok = code_reward(fence("print(1 / int(input()))"), cc, data_source="codecontests")
    assert ok["score"] == 1.0 and ok["verdict"]["compare"] == "tokens"  # 0.3333333333333333 vs 0.333333: 1e-5
    cf = {"official_tests": [{"input": "3\n", "output": "YES\n"}, {"input": "4\n", "output": "NO"}],
          "time_limit": 1.0, "memory_limit": 256.0, "generated_checker": "..."}
    p = parse_ground_truth(cf, data_source="codeforces")
    assert (p.time_limit, p.memory_limit_mb, p.checker_ignored) == (1.0, 256, True)
    res = compute_score("codeforces", fence("print('yes' if int(input()) % 2 else 'no')"), cf)
    assert res["score"] == 1.0 and "special checker" in res["verdict"]["notes"][0]  # case-insensitive tokens
    slow = compute_score("codeforces", fence("import time\ntime.sleep(1.5)\nprint('YES')"), cf)
    assert slow["verdict"]["cases"][0]["verdict"] == "timeout"  # the problem's own 1 s limit


def test_the_comparison_rules():
    # APPS/TACO lines: trimmed lines, blank lines dropped; numbers close unless all integers
    assert lines_match("3 \n\n4\n", " 3\n4")
    assert not lines_match("3 4", "3\n4") and not lines_match("4\n3", "3\n4")
    assert lines_match("0.3333333", "0.33333333") and not lines_match("1", "2") and not lines_match("0.3", "0.4")
    assert not lines_match("1000001", "1000000")  # integers compare exactly
    # CodeContests tokens: whitespace and case free, floats within 1e-5, integers exact
    assert tokens_match("YES 1\n2", "yes\n1 2") and tokens_match("0.1000001", "0.1")
    assert not tokens_match("0.10002", "0.1") and not tokens_match("10", "10.000001 5")
    assert not tokens_match("3", "4") and not tokens_match("abc", "abd")
    for bad, message in [("{", "not JSON"), ({"inputs": [1]}, "no outputs"), ({"inputs": ["1"], "outputs": []},
                         "1 inputs but 0 outputs"), ({"inputs": [], "outputs": []}, "no test cases"),
                         ({"foo": 1}, "unknown layout"), ({"inputs": [[1]], "outputs": [1], "fn_name": "a b"},
                                                          "not a Python identifier")]:
        with pytest.raises(ValueError, match=message):
            parse_ground_truth(bad)
    # a bad record costs only itself: score 0 with the reason
    bad = code_reward(ADD, {"inputs": ["1"]})
    assert bad["score"] == 0.0 and "no outputs" in bad["verdict"]["error"]
    assert code_reward("I cannot solve this.\n```cpp\nint main(){}\n```", {"inputs": ["1"], "outputs": ["1"]}
                       )["verdict"]["error"] == "the response holds no Python program"


# ------------------------------------------------------------------------------------------ hostile programs
class _Recorder(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"leaked")

    def log_message(self, *args):
        return None


@pytest.fixture()
def host_server():
    """A server on the host's loopback the sandboxed program tries to reach."""
    _Recorder.hits = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


HOSTILE = {
    # name: (program, expected verdict)
    "read_outside_scratch": ("import os\nprint(sorted(os.listdir('/')))\nprint(open(SECRET).read())", "runtime_error"),
    "socket_to_the_host": ("import urllib.request\nprint(urllib.request.urlopen(f'http://127.0.0.1:{PORT}/x', "
                           "timeout=2).read())", "runtime_error"),
    "socket_to_the_internet": ("import socket\nsocket.create_connection(('pypi.org', 443), timeout=2)",
                               "runtime_error"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "runtime_error"),
    "stubborn_fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                           "timeout"),
    "infinite_loop": ("while True:\n    pass", "timeout"),
    "sleeping_forever": ("import time\ntime.sleep(10**6)", "timeout"),
    "memory_bomb": ("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))", "memory_limit"),
    "one_huge_allocation": ("x = bytearray(1 << 40)", "memory_limit"),
    "gigabytes_of_output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "output_limit"),
    "gigabytes_on_disk": ("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (8 << 20))\n    i += 1",
                          "file_limit"),
    "one_huge_file": ("with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))", "file_limit"),
    "kill_the_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)\n"
                        "os.kill(TRAINER, signal.SIGKILL)", "runtime_error"),
    "kill_everything": ("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('still here')", "runtime_error"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained_scored_zero_and_reported(name, sandbox, host_server, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the trainer's secret")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)  # readable by anyone on the host: only the sandbox keeps it out
    code, want = HOSTILE[name]
    code = code.replace("SECRET", repr(str(secret))).replace("PORT", str(host_server)).replace(
        "TRAINER", str(os.getpid()))
    t0 = time.monotonic()
    run = sandbox.run(code, "", Limits(time_s=2, memory_mb=256))
    assert run.status == want, (run.status, run.detail, run.stderr[-500:])
    assert time.monotonic() - t0 < 30
    assert_contained(run)
    # the same program as a rollout: scored 0, its verdict reported
    gt = {"inputs": [""], "outputs": ["the trainer's secret"]}
    res = code_reward(fence(code), gt, runner=sandbox)
    assert res["score"] == 0.0 and res["verdict"]["cases"][0]["verdict"] == want, res["verdict"]
    # the host is untouched
    assert _Recorder.hits == []
    assert secret.read_text() == "the trainer's secret"
    if name == "read_outside_scratch":  # the root holds the system directories, /proc, /dev and the scratch only
        seen = set(ast.literal_eval(run.stdout.splitlines()[0]))
        assert {"usr", "proc", "dev", "sandbox"} <= seen <= {"usr", "proc", "dev", "sandbox", *SYSTEM_LINKS}
        assert "No such file or directory" in run.stderr
    if name == "kill_the_parent":
        assert "ProcessLookupError" in run.stderr  # the trainer's pid does not exist in the sandbox


def test_limits_and_missing_tools_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="memory_mb must be a positive number"):
        Limits(memory_mb=0)
    with pytest.raises(ValueError, match=r"unknown sandbox limits \['wall'\]"):
        Limits.from_options({"wall": 3})
    with pytest.raises(ValueError, match="unknown local sandbox options"):
        local_sandbox({"image": "x"})
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        BubblewrapSandbox(bwrap=str(tmp_path / "bwrap")).run("print(1)")
    with pytest.raises(SandboxUnavailable, match="interpreter .* does not exist"):
        BubblewrapSandbox(python=str(tmp_path / "python3")).run("print(1)")
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="not under a directory the sandbox binds"):
        BubblewrapSandbox(python=str(fake)).run("print(1)")


# ------------------------------------------------------------------------------------------ many at once
def test_a_batch_runs_on_a_bounded_pool_in_order():
    program = "import time\nt = time.time()\ntime.sleep(0.3)\nprint(t, time.time(), input())"
    jobs = [(program, parse_ground_truth({"inputs": [f"job{i}"], "outputs": ["anything"]})) for i in range(12)]
    box = BubblewrapSandbox(limits=Limits(time_s=10), max_concurrent=3)
    runs = []
    lock = threading.Lock()

    class Spy(CodeRunner):
        """The sandbox, keeping every run's output."""

        name, max_concurrent, limits = "spy", 3, box.limits

        def run(self, program, stdin="", limits=None):
            out = box.run(program, stdin, limits)
            with lock:
                runs.append(out)
            return out

    spy = Spy()
    verdicts = judge_many(spy, jobs, max_workers=8)  # more threads than sandboxes: the sandbox bounds them
    assert len(verdicts) == 12 and all(v.cases[0].verdict == "wrong_answer" for v in verdicts)
    assert all(f"job{i}" in v.cases[0].detail for i, v in enumerate(verdicts))  # in the order of the jobs
    spans = [tuple(map(float, r.stdout.split()[:2])) for r in runs]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak <= 3, peak
    assert peak >= 2  # and they did run side by side


def test_verls_reward_manager_scores_a_batch_with_hostile_rollouts_and_goes_on(tmp_path):
    """verl's reward loop path: the `apertus` manager built by verl from the RLVR config, every sample at once."""
    import torch
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from transformers import PreTrainedTokenizerFast
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer
    from verl_ext import rewards

    rewards.register_reward_manager()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl_ext.config", version_base=None):
        cfg = compose(config_name="apertus_rlvr")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(build_test_tokenizer(tmp_path) / "tokenizer.json"))
    manager = load_reward_manager(cfg, tok, reward_router_address=None, reward_model_tokenizer=None)
    gt = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    samples = [("apps", ADD, gt, 1.0), ("taco", fence("print(4)"), gt, 0.0), ("exact_match", "Paris", "Paris", 1.0)]
    samples += [("codecontests", fence(HOSTILE[n][0].replace("TRAINER", str(os.getpid()))), gt, 0.0)
                for n in ("fork_bomb", "infinite_loop", "one_huge_allocation", "gigabytes_of_output", "kill_everything")]

    def item(source, text, truth):
        ids = tok(text, add_special_tokens=False)["input_ids"][:200] or [0]
        resp = torch.tensor([ids + [0] * (200 - len(ids))])
        return DataProto.from_dict(
            tensors={"prompts": torch.zeros(1, 4, dtype=torch.long), "responses": resp,
                     "attention_mask": torch.cat([torch.ones(1, 4), (resp != 0).float()], 1).long()},
            non_tensors={"data_source": [source], "reward_model": [{"ground_truth": truth}], "extra_info": [{}]})

    async def all_at_once():
        return await asyncio.gather(*[manager.run_single(item(s, t, g)) for s, t, g, _ in samples])

    t0 = time.monotonic()
    outs = manager.loop.run_until_complete(all_at_once())
    assert time.monotonic() - t0 < 120
    assert [o["reward_score"] for o in outs] == [want for *_, want in samples]
    # every sample has the same extra-info keys (verl stacks them); the code verdicts are in reward_info
    assert all(set(o["reward_extra_info"]) == {"acc", "reward_info"} for o in outs)
    assert outs[2]["reward_extra_info"]["reward_info"] == ""
    verdicts = [json.loads(o["reward_extra_info"]["reward_info"])["verdict"]["cases"][0]["verdict"] for o in outs[3:]]
    assert verdicts[1:4] == ["timeout", "memory_limit", "output_limit"]
    assert verdicts[0] in ("runtime_error", "timeout") and verdicts[4] == "runtime_error"
    assert registry().reward_functions["code"] is code_reward


# ------------------------------------------------------------------------------------------ SandboxFusion
class _FusionAPI(BaseHTTPRequestHandler):
    """SandboxFusion's ``run_code`` API on loopback (its request and response layout), running the code in the
    local sandbox: what verl's client talks to."""

    box: BubblewrapSandbox
    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        run = self.box.run(body["code"], body.get("stdin") or "",
                           Limits(time_s=float(body["run_timeout"]), memory_mb=int(body["memory_limit_MB"])))
        status = {"ok": "Finished", "timeout": "TimeLimitExceeded"}.get(run.status, "Finished")
        reply = {"status": "Success" if run.status == "ok" else "Failed", "message": "",
                 "compile_result": None,
                 "run_result": {"status": status, "execution_time": run.seconds, "return_code": run.exit_code,
                                "stdout": run.stdout, "stderr": run.stderr}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        return None


def test_sandbox_fusion_backend_through_verls_client(sandbox):
    from verl_ext.sandbox_fusion import SandboxFusionRunner

    _FusionAPI.box, _FusionAPI.requests = sandbox, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FusionAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
        gt = {"inputs": ["1 2\n", "2 2\n"], "outputs": ["3\n", "4\n"]}
        ok = compute_score("apps", ADD, gt, code_sandbox={"backend": "sandbox_fusion", "url": url,
                                                          "max_concurrent": 2, "memory_limit_mb": 512})
        assert ok["score"] == 1.0 and ok["verdict"]["backend"] == "sandbox_fusion"
        req = _FusionAPI.requests[-1]
        assert (req["language"], req["memory_limit_MB"], req["stdin"]) == ("python", 512, "2 2\n")
        call = {"inputs": [[2, 3]], "outputs": [[6]], "fn_name": "mul"}
        assert compute_score("taco", fence("def mul(a, b):\n    return a * b"), call,
                             code_sandbox={"backend": "sandbox_fusion", "url": url})["score"] == 1.0
        slow = compute_score("apps", fence("while True: pass"), gt,
                             code_sandbox={"backend": "sandbox_fusion", "url": url, "limits": {"time_s": 1}})
        assert slow["verdict"]["cases"][0]["verdict"] == "timeout"
        with pytest.raises(SandboxUnavailable, match="cannot run a probe program"):
            SandboxFusionRunner(f"http://127.0.0.1:{free_port()}/run_code").run("print(1)")
        with pytest.raises(ValueError, match="needs a url"):
            compute_score("apps", ADD, gt, code_sandbox={"backend": "sandbox_fusion"})
    finally:
        server.shutdown()
        server.server_close()
