"""The Apertus lm-eval tasks in the real lm-eval harness: against a real vLLM server end to end,
their settings against the core's protocol facts, and their errors."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import SERVED_NAME

from apertus_plugins.cli.eval_path import include_path
from apertus_plugins.infra.client import http_json
from apertus_plugins.posttrain.evaluation import DEFAULT_DECODING, THINKING_DECODING, stop_strings
from apertus_plugins.testing.serve import VLLMServer

LM_EVAL = include_path("lm_eval")

TASKS = ["apertus_mmlu_chat", "apertus_arc_challenge_chat", "apertus_gsm8k_chat", "apertus_math500_chat",
         "apertus_ifeval_chat", "apertus_switzerland_qa", "apertus_or_bench_hard", "apertus_bfcl_v3_simple",
         "apertus_bfcl_v3_parallel", "apertus_bfcl_v3_irrelevance", "apertus_mmlu_chat_think",
         "apertus_charter_alignment"]
METRICS = {
    "apertus_mmlu_chat": "exact_match", "apertus_arc_challenge_chat": "exact_match",
    "apertus_gsm8k_chat": "exact_match", "apertus_math500_chat": "math_verify",
    "apertus_ifeval_chat": "prompt_level_loose_acc", "apertus_switzerland_qa_de": "exact_match",
    "apertus_or_bench_hard": "refusal_rate", "apertus_bfcl_v3_simple": "acc", "apertus_bfcl_v3_parallel": "acc",
    "apertus_bfcl_v3_irrelevance": "acc", "apertus_mmlu_chat_think": "exact_match",
    "apertus_charter_alignment": "charter_score",
}


def _yaml(path: Path) -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return yaml.load(path.read_text(), Loader=Loader)


def _task_yamls() -> list[Path]:
    return sorted(p for p in LM_EVAL.rglob("apertus_*.yaml") if "task" in _yaml(p) and "group" not in _yaml(p))


@pytest.mark.parametrize("path", _task_yamls(), ids=lambda p: p.stem)
def test_every_task_follows_the_protocol(path: Path) -> None:
    cfg = _yaml(path)
    if "include" in cfg:
        cfg = {**_yaml(path.parent / cfg["include"]), **cfg}
    gen = cfg["generation_kwargs"]
    thinking = gen["chat_template_kwargs"]["enable_thinking"]
    want = THINKING_DECODING if thinking else DEFAULT_DECODING
    assert cfg["task"].startswith("apertus_") and cfg["task"].endswith("_think") == thinking
    assert gen["max_gen_toks"] == want["max_new_tokens"] and gen["temperature"] == want["temperature"]
    assert gen.get("top_p", None) == want.get("top_p", None)
    assert gen["skip_special_tokens"] is False  # the thinking span and the call markers stay visible
    tool_task = "bfcl" in cfg["task"]
    assert gen["until"] == stop_strings(tool_calls=tool_task)
    assert gen.get("include_stop_str_in_output", False) is tool_task
    assert (path.parent / "utils.py").is_file()
    assert "degenerate" in [m["metric"] for m in cfg["metric_list"]]


def test_eval_path_cli_prints_the_include_paths() -> None:
    for harness in ("lm_eval", "lmms_eval"):
        out = subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "eval-path", harness], check=True,
                             capture_output=True, text=True).stdout.strip()
        assert Path(out) == include_path(harness) and Path(out).is_dir()


def _run_lm_eval(server: VLLMServer, tasks: list[str], out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-chat-completions",
           "--model_args", f"base_url={server.base_url}/chat/completions,model={SERVED_NAME},tokenizer_backend=none",
           "--apply_chat_template", "--fewshot_as_multiturn", "--tasks", ",".join(tasks),
           "--include_path", str(LM_EVAL), "--gen_kwargs", "max_gen_toks=12",
           "--output_path", str(out), "--log_samples"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _chat(logged: str | list) -> list[dict]:
    """The chat history of a logged request (lm-eval logs its JSON string, wrapped in a list)."""
    return json.loads(logged[0] if isinstance(logged, list) else logged)


def _judge_env(server_url: str, data: Path, top_logprobs: int) -> dict[str, str]:
    return {"APERTUS_EVAL_JUDGE_URL": server_url, "APERTUS_EVAL_JUDGE_MODEL": SERVED_NAME,
            "APERTUS_EVAL_CHARTER": str(data / "charter.md"), "APERTUS_EVAL_JUDGE_TOP_LOGPROBS": str(top_logprobs)}


def test_lm_eval_runs_every_task_end_to_end(vllm_server: VLLMServer, judge_top_logprobs: int, data_env: Path,
                                            tmp_path: Path) -> None:
    # the served checkpoint is also the charter-alignment judge: it returns logprobs over its whole
    # output vocabulary, so every rating digit is among the alternatives
    env = {**os.environ, **_judge_env(vllm_server.base_url, data_env, judge_top_logprobs)}
    proc = _run_lm_eval(vllm_server, TASKS, tmp_path / "out", env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results_files = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    assert len(results_files) == 1
    results = json.loads(Path(results_files[0]).read_text())["results"]
    for task, metric in METRICS.items():
        assert f"{metric},none" in results[task], (task, results[task])
        assert "degenerate,none" in results[task]
        assert 0.0 <= results[task][f"{metric},none"] <= (9.0 if metric == "charter_score" else 1.0)
    for lang in ("en", "de", "fr", "it", "rm"):
        assert f"apertus_switzerland_qa_{lang}" in results
    samples = {Path(f).name.split("_20")[0]: [json.loads(x) for x in Path(f).read_text().splitlines()]
               for f in glob.glob(str(tmp_path / "out" / "**" / "samples_*.jsonl"), recursive=True)}
    # the small cap from the command line reached every request; the protocol's settings stayed
    gsm = samples["samples_apertus_gsm8k_chat"][0]["arguments"]["gen_args_0"]
    assert gsm["arg_1"]["max_gen_toks"] == 12 and gsm["arg_1"]["chat_template_kwargs"] == {"enable_thinking": False}
    history = _chat(gsm["arg_0"])
    assert [m["role"] for m in history] == ["user", "assistant"] * 8 + ["user"]  # eight shots as turns
    think = samples["samples_apertus_mmlu_chat_think"][0]["arguments"]["gen_args_0"]["arg_1"]
    assert think["chat_template_kwargs"] == {"enable_thinking": True} and think["temperature"] == 0.6
    # BFCL: the item's own messages, its tools in the template's kwargs, one request group per item
    bfcl = samples["samples_apertus_bfcl_v3_parallel"][0]["arguments"]["gen_args_0"]
    assert _chat(bfcl["arg_0"])[0] == {"role": "system", "content": "Be brief."}
    assert bfcl["arg_1"]["chat_template_kwargs"]["tools"][0]["function"]["name"] == "add"
    assert bfcl["arg_1"]["user"] == "apertus_bfcl_v3_parallel/parallel_0"
    for name, rows in samples.items():
        for row in rows:
            assert isinstance(row["resps"][0][0], str), name


def test_bfcl_tools_reach_the_developer_block(vllm_server: VLLMServer) -> None:
    """What the BFCL requests carry renders the tools where the template declares them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bfcl_utils", LM_EVAL / "bfcl_v3" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    doc = {"functions": json.dumps([{"name": "add", "description": "Add two numbers.",
                                     "parameters": {"type": "dict", "properties": {"a": {"type": "float"}}}}])}
    status, body = http_json(vllm_server.url("/tokenize"), {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "Add 1 and 2."}],
        "chat_template_kwargs": {"enable_thinking": False, "tools": utils.tools_of(doc)},
        "add_generation_prompt": True, "return_token_strs": True})
    assert status == 200, body
    prompt = "".join(body["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")
    assert "Tool Capabilities:\n// Add two numbers.\ntype add = (_: {\na?: number\n}) => any;" in prompt


def test_missing_data_names_the_task_and_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    for key in [k for k in os.environ if k.startswith("APERTUS_EVAL_DATA")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tm = TaskManager(include_path=str(LM_EVAL), include_defaults=False)
    from eval_tasks.data import DataPathError

    # a gated dataset without a local copy
    with pytest.raises(DataPathError, match=r"task apertus_switzerland_qa_de: no local data .*"
                                            r"APERTUS_EVAL_DATA_SWITZERLAND_QA.*gated"):
        tm.load_task_or_group(["apertus_switzerland_qa_de"])
    # a path that does not exist
    monkeypatch.setenv("APERTUS_EVAL_DATA_MMLU", str(tmp_path / "nowhere"))
    with pytest.raises(DataPathError, match=r"task apertus_mmlu_chat: the data path .*nowhere given by "
                                            r"APERTUS_EVAL_DATA_MMLU does not exist"):
        tm.load_task_or_group(["apertus_mmlu_chat"])
    # a folder without the split
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("APERTUS_EVAL_DATA_MMLU", str(tmp_path / "empty"))
    with pytest.raises(DataPathError, match=r"task apertus_mmlu_chat: no data for split 'test' under .*empty"):
        tm.load_task_or_group(["apertus_mmlu_chat"])
    # BFCL's files are looked up in their published layout
    (tmp_path / "bfcl").mkdir()
    monkeypatch.setenv("APERTUS_EVAL_DATA_BFCL_V3", str(tmp_path / "bfcl"))
    with pytest.raises(DataPathError, match=r"task apertus_bfcl_v3_simple: .*BFCL_v3_simple.json .*does not exist"):
        tm.load_task_or_group(["apertus_bfcl_v3_simple"])


def test_the_fewshot_prompt_of_a_local_task(data_env: Path) -> None:
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(LM_EVAL), include_defaults=False).load_task_or_group(["apertus_arc_challenge_chat"])
    task = task["apertus_arc_challenge_chat"] if isinstance(task, dict) else next(iter(task.values()))
    docs = list(task.test_docs())
    assert [task.doc_to_target(d) for d in docs] == ["B", "A"]  # numeric labels map to letters
    assert "(B) carbon dioxide" in task.doc_to_text(docs[0])


def test_an_unreachable_judge_names_the_task_and_the_setting(data_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    from apertus_plugins.testing.serve import free_port

    tm = TaskManager(include_path=str(LM_EVAL), include_defaults=False)
    url = f"http://127.0.0.1:{free_port()}/v1"
    for key, value in _judge_env(url, data_env, 20).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match=r"task apertus_charter_alignment: the judge given by "
                                           r"APERTUS_EVAL_JUDGE_URL=http://127.0.0.1:\d+/v1 .*unreachable"):
        tm.load_task_or_group(["apertus_charter_alignment"])
    monkeypatch.delenv("APERTUS_EVAL_JUDGE_URL")
    with pytest.raises(RuntimeError, match=r"task apertus_charter_alignment: no judge; set APERTUS_EVAL_JUDGE_URL"):
        tm.load_task_or_group(["apertus_charter_alignment"])
