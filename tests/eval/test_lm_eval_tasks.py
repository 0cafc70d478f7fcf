"""The Apertus lm-eval tasks, derived from the installed lm-eval's own task configs, in the real
lm-eval harness: their generated folder, their settings against the core's protocol facts,
against a real vLLM server end to end, and their errors."""

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

from apertus_plugins.infra.client import http_json
from apertus_plugins.posttrain.evaluation import DEFAULT_DECODING, MEAN_AT_K, THINKING_DECODING, stop_strings
from apertus_plugins.testing.serve import VLLMServer
from eval_tasks.catalogue import by_id, load, mismatches
from eval_tasks.derive import base_generation_kwargs, include_path, manifest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_TASKS = ROOT / "eval_tasks" / "lm_eval"


@pytest.fixture(scope="module")
def lm_eval_path() -> Path:
    return include_path("lm_eval")


def _yaml(path: Path) -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return yaml.load(path.read_text(), Loader=Loader)


def _resolved(path: Path) -> dict:
    """A generated task's config with its includes resolved by lm-eval's own loader (functions unresolved)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=False)


def test_every_derived_task_follows_the_protocol(lm_eval_path: Path) -> None:
    """Each task is upstream's YAML of the installed lm-eval (or this package's template) by ``include:``
    with the protocol's generation settings on top; thinking variants sample with the thinking budget
    and repeat where the report reports mean@k."""
    catalogue = by_id()
    templates = {str(PACKAGE_TASKS / str(b.template)): b for b in load() if b.kind == "handwritten"}
    checked = 0
    for path in sorted(lm_eval_path.glob("*.yaml")):
        cfg = _yaml(path)
        if "group" in cfg:
            continue
        name = cfg["task"]
        assert Path(cfg["include"]).is_absolute() and Path(cfg["include"]).is_file(), name
        b = templates.get(cfg["include"]) or catalogue[cfg["metadata"]["apertus_benchmark"]]
        mode = "think" if name.endswith("_think") else "base" if name.endswith("_base") and b.base_run else "off"
        if b.kind_in(mode) == "base" and b.kind == "handwritten":  # this package's task on the base model
            assert cfg["generation_kwargs"] == base_generation_kwargs() and "class" not in cfg, name
            continue
        if b.kind_in(mode) not in ("chat", "handwritten"):
            assert "generation_kwargs" not in cfg and "class" not in cfg, name  # upstream's own scoring
            continue
        gen, thinking = cfg["generation_kwargs"], name.endswith("_think")
        want = THINKING_DECODING if thinking else DEFAULT_DECODING
        assert gen["chat_template_kwargs"] == {"enable_thinking": thinking}, name
        assert gen["max_gen_toks"] == want["max_new_tokens"] and gen["temperature"] == want["temperature"]
        assert gen.get("top_p") == want.get("top_p") and gen["do_sample"] is thinking
        assert gen["skip_special_tokens"] is False  # the thinking span and the call markers stay visible
        tools = "tools" in b.needs
        assert gen["until"] == stop_strings(tool_calls=tools) and gen.get("include_stop_str_in_output", False) is tools
        k = MEAN_AT_K[b.think] if thinking and isinstance(b.think, str) else 1
        assert cfg.get("repeats", 1) == k, name
        if b.kind == "chat":
            assert cfg["class"] == "eval_tasks.lm_eval.protocol.ApertusTask", name
        checked += 1
    assert checked > 300  # MMLU's 57 subjects, BBH's 27 tasks... twice with thinking
    # the folder's named tasks are exactly the catalogue's text benchmarks, in the modes the report runs them
    tasks = manifest("lm_eval")["tasks"]
    assert set(tasks) == {t for b in load() if b.runnable and b.harness == "lm_eval" for t in b.tasks.values()}
    assert tasks["apertus_aime24_think"]["repeats"] == 8 and tasks["apertus_minerva_math500_think"]["repeats"] == 4
    assert tasks["apertus_humaneval_instruct_think"]["repeats"] == 4 and tasks["apertus_ifeval"]["repeats"] == 1


def _leaf(folder: Path, name: str) -> Path:
    """The first task of a derived task or group (the members of a group share their setting)."""
    path = folder / f"{name}.yaml"
    cfg = _yaml(path)
    return _leaf(folder, cfg["task"][0]) if "group" in cfg else path


def test_every_number_pairs_the_shots_of_the_derived_task(lm_eval_path: Path) -> None:
    """Like for like, by the task definition itself: each derived task's shots (its config with
    upstream's includes resolved) against the cited table's, and its metric, categories and thinking
    mode (the catalogue's check); a number for another protocol says why and shows no difference."""
    catalogue, checked = by_id(), 0
    for path in lm_eval_path.glob("*.yaml"):  # no group is its own member (MMLU's flan CoT "stem" once was)
        cfg = _yaml(path)
        assert "group" not in cfg or cfg["group"] not in cfg["task"], path.name
    for name, info in manifest("lm_eval")["tasks"].items():
        b, mode = catalogue[info["benchmark"]], info["mode"]
        shots = int(_resolved(_leaf(lm_eval_path, name)).get("num_fewshot") or 0)
        for row in b.rows:
            ref = row.reference.get(mode)
            if ref is not None:
                assert bool(mismatches(b, mode, ref, shots=shots)) == bool(ref.unlike), (name, ref.cite(), shots)
                checked += 1
    assert checked > 80
    # the base suite's variants: upstream's prompt and shots, no protocol class, no chat settings
    bbh = _yaml(_leaf(lm_eval_path, "apertus_bbh_base"))
    assert "class" not in bbh and "generation_kwargs" not in bbh and _resolved(_leaf(lm_eval_path, "apertus_bbh_base"))[
        "num_fewshot"] == 3
    assert manifest("lm_eval")["tasks"]["apertus_bbh_base"]["kind"] == "base"


def test_global_mmlu_is_generated_and_its_letter_read(lm_eval_path: Path) -> None:
    """Global-MMLU as the report scores it: generated (not log-likelihood), the answer letter read
    from the reply and compared by exact match; the groups average that metric."""
    from lm_eval.filters.extraction import RegexFilter

    leaf = _resolved(_leaf(lm_eval_path, "apertus_global_mmlu"))
    assert leaf["output_type"] == "generate_until" and leaf.get("doc_to_choice") is None
    assert [m["metric"] for m in leaf["metric_list"]] == ["exact_match"]
    group = _yaml(lm_eval_path / "apertus_global_mmlu_en.yaml")
    assert group["aggregate_metric_list"] == [{"metric": "exact_match", "aggregation": "mean",
                                               "weight_by_size": False, "filter_list": ["letter"]}]
    regex = leaf["filter_list"][0]["filter"][0]["regex_pattern"]
    replies = ["B", "B.", "(C) because", "The answer is D.", "Answer: **A**", "**C**", "I think it is neither"]
    got = RegexFilter(regex_pattern=regex, group_select=0).apply([[r] for r in replies], [{}] * len(replies))
    assert [g[0] for g in got] == ["B", "B", "C", "D", "A", "C", "[invalid]"]


def test_no_upstream_config_is_copied(lm_eval_path: Path) -> None:
    """The package holds templates only where upstream has no task, and BFCL's eleven categories and
    SwitzerlandQA's five languages come from one definition each (their ``SUBTASKS``)."""
    yamls = sorted(p.relative_to(PACKAGE_TASKS).as_posix() for p in PACKAGE_TASKS.rglob("*.yaml"))
    assert yamls == ["alpacaeval2/apertus_alpacaeval2.yaml", "bfcl_v3/bfcl_v3.yaml",
                     "charter_alignment/apertus_charter_alignment.yaml", "ifbench/apertus_ifbench.yaml",
                     "or_bench/apertus_or_bench_hard.yaml", "squad_v2/apertus_squad_v2.yaml",
                     "switzerland_qa/switzerland_qa.yaml", "wmt24pp/apertus_wmt24pp.yaml"]
    for path in PACKAGE_TASKS.rglob("*.yaml"):
        assert "generation_kwargs" not in _yaml(path), path  # the protocol's settings are stated in one place
    bfcl = sorted(lm_eval_path.glob("apertus_bfcl_v3_*.yaml"))
    assert len(bfcl) == 12  # eleven categories and their group
    for path in bfcl:
        cfg = _yaml(path)
        if "group" in cfg:
            assert len(cfg["task"]) == 11
            continue
        assert cfg["include"] == str(PACKAGE_TASKS / "bfcl_v3" / "bfcl_v3.yaml")
        assert cfg["metadata"]["bfcl_category"] == cfg["task"][len("apertus_bfcl_v3_"):]


def test_eval_path_is_generated_once_and_deterministic(lm_eval_path: Path, tmp_path: Path) -> None:
    """`apertus eval-path` writes the folder once (a second call reads no harness config and writes
    nothing), with the same bytes as the folder another process generated (the suite's)."""
    env = {**os.environ, "APERTUS_EVAL_TASKS_CACHE": str(tmp_path / "cache")}
    folders = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "eval-path", "lm_eval"], check=True,
                             capture_output=True, text=True, env=env).stdout.strip()
        folders.append(Path(out))
    folder = folders[0]
    assert folders[1] == folder and folder.parent == tmp_path / "cache" and folder.name == lm_eval_path.name
    assert [p.name for p in folder.parent.iterdir() if not p.name.startswith(".")] == [folder.name]  # one copy
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in lm_eval_path.iterdir())
    assert all((folder / p.name).read_bytes() == p.read_bytes() for p in lm_eval_path.iterdir())


@pytest.fixture(scope="module")
def manager(lm_eval_path: Path):
    """lm-eval's task manager over the Apertus folder alone (its index is built once for the module)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(lm_eval_path), include_defaults=False)


def _task(manager, name: str):
    return manager.load([name])["tasks"][name]


def _history(task, doc) -> list[dict]:
    """The chat history lm-eval sends for ``doc`` with the chat template and shots as turns."""
    return task.fewshot_context(doc, task.config.num_fewshot, apply_chat_template=True, fewshot_as_multiturn=True,
                                chat_template=lambda msgs, add_generation_prompt=True: msgs)


def test_math500_is_the_minerva_prompt_with_four_shots_as_turns(manager, data_env: Path) -> None:
    """MATH-500 as Table L.1 runs it: the Minerva prompt, 4 shots, each shot an earlier turn (it was 0-shot)."""
    b = by_id()["math500"]
    assert b.tasks == {"off": "apertus_minerva_math500", "think": "apertus_minerva_math500_think"}
    task = _task(manager, "apertus_minerva_math500")
    assert task.config.num_fewshot == 4
    docs = list(task.test_docs())
    history = _history(task, docs[0])
    assert [m["role"] for m in history] == ["user", "assistant"] * 4 + ["user"]
    assert history[-1]["content"].startswith("Problem:\n") and "\\frac{1}{2}" in history[-1]["content"]
    assert "Final Answer: The final answer is" in history[1]["content"]  # Minerva's worked answers
    assert b.multi_turn  # the report runner passes --fewshot_as_multiturn


def test_mean_at_k_scores_every_sampled_run(manager, data_env: Path) -> None:
    """The thinking variant of MATH-500 samples 4 runs per problem and scores their mean (mean@4, Table 25),
    through lm-eval's own repeats: each answer goes through upstream's extraction (thinking stripped first)."""
    from lm_eval.api.instance import Instance

    task = _task(manager, "apertus_minerva_math500_think")
    assert task.config.repeats == 4
    doc = list(task.test_docs())[0]  # 1/2 + 1/4 = 3/4
    right = "<think>add them</think>Final Answer: The final answer is $\\frac{3}{4}$. I hope it is correct."
    wrong = "Final Answer: The final answer is $7$. I hope it is correct."
    unclosed = "<think>Final Answer: The final answer is $\\frac{3}{4}$."  # the budget ran out while thinking
    inst = Instance(request_type="generate_until", doc=doc, arguments=("", {}), idx=0,
                    metadata=("apertus_minerva_math500_think", 0, 4))
    inst.resps = [right, wrong, right, unclosed]
    task._instances = [inst]
    task.apply_filters()
    scores = [task.process_results(doc, [inst.filtered_resps[key]]) for key in inst.filtered_resps]
    for s in scores:
        assert s["math_verify"] == 0.5 and s["degenerate"] == 0.0  # 2 of 4 runs, the unclosed one scores nothing


def test_derived_tasks_read_local_data_and_strip_thinking(manager, data_env: Path) -> None:
    from lm_eval.api.instance import Instance

    task = _task(manager, "apertus_arc_challenge_chat")
    docs = list(task.test_docs())
    assert [task.doc_to_target(d) for d in docs] == ["B", "A"]  # upstream's target (numeric labels to letters)
    inst = Instance(request_type="generate_until", doc=docs[0], arguments=("", {}), idx=0,
                    metadata=("apertus_arc_challenge_chat", 0, 1))
    inst.resps = ["<think>A? no, B</think>B"]
    task._instances = [inst]
    task.apply_filters()
    assert inst.filtered_resps == {"remove_whitespace": "B"}  # upstream's filter on the visible answer
    assert task.process_results(docs[0], ["B"])["exact_match"] == 1.0


def test_missing_data_names_the_task_and_the_setting(lm_eval_path: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    from eval_tasks.data import DataPathError

    for key in [k for k in os.environ if k.startswith("APERTUS_EVAL_DATA")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tm = TaskManager(include_path=str(lm_eval_path), include_defaults=False)
    with pytest.raises(DataPathError, match=r"task apertus_switzerland_qa_de: no local data .*"
                                            r"APERTUS_EVAL_DATA_SWITZERLAND_QA.*gated"):
        tm.load(["apertus_switzerland_qa_de"])
    monkeypatch.setenv("APERTUS_EVAL_DATA_MATH_500", str(tmp_path / "nowhere"))
    with pytest.raises(DataPathError, match=r"task apertus_minerva_math500: the data path .*nowhere given by "
                                            r"APERTUS_EVAL_DATA_MATH_500 does not exist"):
        tm.load(["apertus_minerva_math500"])
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("APERTUS_EVAL_DATA_MATH_500", str(tmp_path / "empty"))
    with pytest.raises(DataPathError, match=r"task apertus_minerva_math500: no data for split 'test' under .*empty"):
        tm.load(["apertus_minerva_math500"])
    (tmp_path / "bfcl").mkdir()
    monkeypatch.setenv("APERTUS_EVAL_DATA_BFCL_V3", str(tmp_path / "bfcl"))
    with pytest.raises(DataPathError, match=r"task apertus_bfcl_v3_simple: .*BFCL_v3_simple.json .*does not exist"):
        tm.load(["apertus_bfcl_v3_simple"])


def test_an_unreachable_judge_names_the_task_and_the_setting(lm_eval_path: Path, data_env: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    from apertus_plugins.testing.serve import free_port

    tm = TaskManager(include_path=str(lm_eval_path), include_defaults=False)
    url = f"http://127.0.0.1:{free_port()}/v1"
    for key, value in _judge_env(url, data_env, 20).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match=r"task apertus_charter_alignment: the judge given by "
                                           r"APERTUS_EVAL_JUDGE_URL=http://127.0.0.1:\d+/v1 .*unreachable"):
        tm.load(["apertus_charter_alignment"])
    with pytest.raises(RuntimeError, match=r"task apertus_alpacaeval2: the judge given by "
                                           r"APERTUS_EVAL_JUDGE_URL=http://127.0.0.1:\d+/v1 .*unreachable"):
        tm.load(["apertus_alpacaeval2"])
    monkeypatch.delenv("APERTUS_EVAL_JUDGE_URL")
    with pytest.raises(RuntimeError, match=r"task apertus_charter_alignment: no judge; set APERTUS_EVAL_JUDGE_URL"):
        tm.load(["apertus_charter_alignment"])
    with pytest.raises(RuntimeError, match=r"task apertus_alpacaeval2: no judge; set APERTUS_EVAL_JUDGE_URL"):
        tm.load(["apertus_alpacaeval2"])


def test_charter_alignment_is_a_length_controlled_win_rate() -> None:
    """Table L.2 scores charter alignment as a length-controlled win rate against baseline answers (it was
    a 0-9 judge score): the task aggregates the judge's preferences with the length term held at zero."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("charter_utils", PACKAGE_TASKS / "charter_alignment" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    cfg = _yaml(PACKAGE_TASKS / "charter_alignment" / "apertus_charter_alignment.yaml")
    assert [m["metric"] for m in cfg["metric_list"]] == ["lc_win_rate", "win_rate", "degenerate"]
    assert by_id()["charter_alignment"].rows[0].metric == "lc_win_rate,none"
    # a judge that prefers whichever answer is longer: the model wins by length only
    items = [(0.9, 900, 300), (0.1, 200, 600), (0.85, 800, 350), (0.15, 250, 700), (0.8, 700, 300), (0.2, 300, 650)]
    assert 0.4 < utils.lc_win_rate(items) < 0.6
    assert utils.lc_win_rate([(0.9, 400, 400), (0.8, 300, 300), (0.9, 500, 500)]) > 0.8


def _alpaca_utils():
    import importlib.util

    spec = importlib.util.spec_from_file_location("alpaca_utils", PACKAGE_TASKS / "alpacaeval2" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    return utils


def test_alpacaeval2_win_rates_follow_the_judges_preferences() -> None:
    """AlpacaEval 2's win rate and length-controlled win rate, computed by alpaca-eval from the judge's
    preferences against the reference outputs: a judge that always prefers the model gives a high win
    rate, one that always prefers the reference a low one, and a judge swayed only by length gives a
    length-controlled win rate near a coin flip where the raw one follows the longer answers."""
    utils = _alpaca_utils()
    assert by_id()["alpacaeval2"].rows[0].metric == "lc_win_rate,none" and by_id()["alpacaeval2"].need("judge") == ""
    ref = "A reference answer of moderate length."
    answers = ["An answer " + "x" * (10 * i) for i in range(6)]
    model_wins = [(i, 0.98, a, ref) for i, a in enumerate(answers)]
    assert utils.win_rate([0.98] * 6) == pytest.approx(0.98)
    assert utils.lc_win_rate(model_wins) > 0.9 and utils.lc_full_glm(model_wins) == 0.0  # offline: the minimal GLM
    reference_wins = [(i, 0.02, a, ref) for i, a in enumerate(answers)]
    assert utils.win_rate([0.02] * 6) == pytest.approx(0.02) and utils.lc_win_rate(reference_wins) < 0.1
    # the judge prefers whichever answer is longer, and most of the model's answers are longer
    lengths = [30 + (37 * k) % 91 for k in range(40)]
    swayed = [(i, 0.9 if n > len(ref) else 0.1, "y" * n, ref) for i, n in enumerate(lengths)]
    raw = utils.win_rate([p for _, p, _, _ in swayed])
    assert raw > 0.7 and abs(utils.lc_win_rate(swayed) - 0.5) < 0.5 * abs(raw - 0.5)


# ------------------------------------------------------------------ end to end against the served checkpoint

E2E_TASKS = ["apertus_arc_challenge_chat", "apertus_gsm8k_cot_llama", "apertus_minerva_math500",
             "apertus_minerva_math500_think", "apertus_ifeval", "apertus_ifbench", "apertus_switzerland_qa", "apertus_or_bench_hard",
             "apertus_bfcl_v3_simple", "apertus_bfcl_v3_parallel", "apertus_bfcl_v3_irrelevance",
             "apertus_charter_alignment", "apertus_global_mmlu", "apertus_alpacaeval2", "apertus_squad_v2",
             "apertus_wmt24pp"]
METRICS = {
    "apertus_arc_challenge_chat": "exact_match,remove_whitespace", "apertus_gsm8k_cot_llama": "exact_match,strict-match",
    "apertus_minerva_math500": "math_verify,none", "apertus_minerva_math500_think": "math_verify,none",
    "apertus_ifeval": "prompt_level_loose_acc,none", "apertus_ifbench": "prompt_level_strict_acc,none",
    "apertus_switzerland_qa_de": "exact_match,none",
    "apertus_or_bench_hard": "refusal_rate,none", "apertus_bfcl_v3_simple": "acc,none",
    "apertus_bfcl_v3_parallel": "acc,none", "apertus_bfcl_v3_irrelevance": "acc,none",
    "apertus_charter_alignment": "lc_win_rate,none", "apertus_alpacaeval2": "lc_win_rate,none",
    "apertus_squad_v2": "f1,none", "apertus_wmt24pp": "chrf,none",
}


def _judge_env(server_url: str, data: Path, top_logprobs: int) -> dict[str, str]:
    return {"APERTUS_EVAL_JUDGE_URL": server_url, "APERTUS_EVAL_JUDGE_MODEL": SERVED_NAME,
            "APERTUS_EVAL_CHARTER": str(data / "charter.md"), "APERTUS_EVAL_JUDGE_TOP_LOGPROBS": str(top_logprobs)}


def _chat(logged: str | list) -> list[dict]:
    """The chat history of a logged request (lm-eval logs its JSON string, wrapped in a list)."""
    return json.loads(logged[0] if isinstance(logged, list) else logged)


def test_lm_eval_runs_the_tasks_end_to_end(vllm_server: VLLMServer, judge_top_logprobs: int, data_env: Path,
                                           lm_eval_path: Path, tmp_path: Path) -> None:
    """lm-eval's own command line (``--include_path "$(apertus eval-path lm_eval)"``) runs derived and
    hand-written tasks against the served checkpoint; the served model is also the charter judge (it
    returns logprobs over its whole output vocabulary, so both verdict digits are among them)."""
    env = {**os.environ, **_judge_env(vllm_server.base_url, data_env, judge_top_logprobs)}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-chat-completions",
           "--model_args", f"base_url={vllm_server.base_url}/chat/completions,model={SERVED_NAME},tokenizer_backend=none",
           "--apply_chat_template", "--fewshot_as_multiturn", "--tasks", ",".join(E2E_TASKS),
           "--include_path", str(lm_eval_path), "--gen_kwargs", "max_gen_toks=12",
           "--output_path", str(tmp_path / "out"), "--log_samples"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results_files = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    assert len(results_files) == 1
    results = json.loads(Path(results_files[0]).read_text())["results"]
    for task, metric in METRICS.items():
        assert metric in results[task], (task, results[task])
        assert "degenerate,none" in results[task] or "degenerate," in " ".join(results[task]), (task, results[task])
        assert 0.0 <= results[task][metric] <= (100.0 if task == "apertus_wmt24pp" else 1.0)  # chrF: 0-100
    for lang in ("en", "de", "fr", "it", "rm"):
        assert f"apertus_switzerland_qa_{lang}" in results
    samples = {Path(f).name.split("_20")[0]: [json.loads(x) for x in Path(f).read_text().splitlines()]
               for f in glob.glob(str(tmp_path / "out" / "**" / "samples_*.jsonl"), recursive=True)}
    # the small cap from the command line reached every request; the protocol's settings stayed
    gsm = samples["samples_apertus_gsm8k_cot_llama"][0]["arguments"]["gen_args_0"]
    assert gsm["arg_1"]["max_gen_toks"] == 12 and gsm["arg_1"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert [m["role"] for m in _chat(gsm["arg_0"])] == ["user", "assistant"] * 8 + ["user"]  # eight shots as turns
    math = samples["samples_apertus_minerva_math500"][0]["arguments"]["gen_args_0"]
    assert [m["role"] for m in _chat(math["arg_0"])] == ["user", "assistant"] * 4 + ["user"]  # Minerva: four
    think = samples["samples_apertus_minerva_math500_think"]
    assert len(think) == 2 and all(len(row["resps"][0]) == 4 for row in think)  # mean@4: four sampled runs each
    args = think[0]["arguments"]["gen_args_0"]["arg_1"]
    assert args["chat_template_kwargs"] == {"enable_thinking": True} and args["temperature"] == 0.6
    # BFCL: the item's own messages, its tools in the template's kwargs, one request group per item
    bfcl = samples["samples_apertus_bfcl_v3_parallel"][0]["arguments"]["gen_args_0"]
    assert _chat(bfcl["arg_0"])[0] == {"role": "system", "content": "Be brief."}
    assert bfcl["arg_1"]["chat_template_kwargs"]["tools"][0]["function"]["name"] == "add"
    assert bfcl["arg_1"]["user"] == "apertus_bfcl_v3_parallel/parallel_0"
    # Global-MMLU, generated: every language's group and the whole average the letter's exact match;
    # each leaf asked through the chat template with thinking off, its letter read from the reply
    from _fixtures import GLOBAL_MMLU_CATEGORIES, GLOBAL_MMLU_LANGS

    assert 0.0 <= results["apertus_global_mmlu"]["exact_match,letter"] <= 1.0
    for lang in GLOBAL_MMLU_LANGS:
        assert 0.0 <= results[f"apertus_global_mmlu_{lang}"]["exact_match,letter"] <= 1.0
    leaves = {name: rows for name, rows in samples.items() if name.startswith("samples_apertus_global_mmlu_")}
    assert len(leaves) == len(GLOBAL_MMLU_LANGS) * len(GLOBAL_MMLU_CATEGORIES)
    for rows in leaves.values():
        assert len(rows) == 1
        row = rows[0]
        args = row["arguments"]["gen_args_0"]
        assert args["arg_1"]["chat_template_kwargs"] == {"enable_thinking": False} and "until" in args["arg_1"]
        assert [m["role"] for m in _chat(args["arg_0"])] == ["user"]
        assert _chat(args["arg_0"])[0]["content"].endswith("Answer with the letter of the correct option.")
        letter = row["filtered_resps"][0]
        assert letter in ("A", "B", "C", "D", "[invalid]"), row["filtered_resps"]
        assert row["exact_match"] == float(letter == row["target"]), row
    # IFBench: every answer scored by lighteval's checkers on the visible answer (the same scores again here)
    from eval_tasks.lm_eval.ifbench.utils import score

    ifbench = samples["samples_apertus_ifbench"]
    assert len(ifbench) == 3
    for row in ifbench:
        again = score(row["doc"], row["resps"][0][0])
        assert row["prompt_level_strict_acc"] == again["prompt_level_strict_acc"], row
        assert row["inst_level_loose_acc"] == again["inst_level_loose_acc"], row
    charter = samples["samples_apertus_charter_alignment"]
    assert all(len(row["lc_win_rate"]) == 3 and 0.0 <= row["win_rate"] <= 1.0 for row in charter)
    # AlpacaEval 2: each instruction's answer judged against its reference output by the named judge; the
    # win rates are alpaca-eval's over exactly those preferences
    from _fixtures import ALPACA_EVAL

    alpaca = sorted(samples["samples_apertus_alpacaeval2"], key=lambda row: row["doc"]["index"])
    assert [row["doc"]["instruction"] for row in alpaca] == [d["instruction"] for d in ALPACA_EVAL]
    assert [row["target"] for row in alpaca] == [d["output"] for d in ALPACA_EVAL]
    assert [m["content"] for m in _chat(alpaca[0]["arguments"]["gen_args_0"]["arg_0"])] == [ALPACA_EVAL[0]["instruction"]]
    items = [row["lc_win_rate"] for row in alpaca]
    assert [(i, ref) for i, _, _, ref in items] == [(k, d["output"]) for k, d in enumerate(ALPACA_EVAL)]
    preferences = [row["win_rate"] for row in alpaca]
    assert all(0.0 <= p <= 1.0 for p in preferences) and [p for _, p, _, _ in items] == preferences
    utils = _alpaca_utils()
    got = results["apertus_alpacaeval2"]
    assert got["win_rate,none"] == pytest.approx(utils.win_rate(preferences))
    assert got["win_rate,none"] == pytest.approx(sum(preferences) / len(preferences))
    assert got["lc_win_rate,none"] == pytest.approx(utils.lc_win_rate(items)) and got["lc_full_glm,none"] == 0.0
    # SQuAD v2: both questions (answerable and not) asked through the chat template, each reply scored again
    from eval_tasks.lm_eval.squad_v2.utils import score as squad_score

    squad = samples["samples_apertus_squad_v2"]
    assert sorted(row["doc"]["id"] for row in squad) == ["sq1", "sq2"]
    for row in squad:
        assert _chat(row["arguments"]["gen_args_0"]["arg_0"])[0]["content"].endswith("\n\nAnswer:")
        assert row["f1"] == squad_score(row["doc"], row["resps"][0][0])["f1"], row
    assert results["apertus_squad_v2"]["f1,none"] == pytest.approx(sum(row["f1"] for row in squad) / 2)
    # WMT24++: the three news items (one per pair) asked through the chat template, scored by sacrebleu's corpus chrF
    import sacrebleu

    wmt = samples["samples_apertus_wmt24pp"]
    assert sorted(row["doc"]["lp"] for row in wmt) == ["en-de_DE", "en-fr_FR", "en-it_IT"]
    per_pair = {}
    for row in wmt:
        prompt = _chat(row["arguments"]["gen_args_0"]["arg_0"])[0]["content"]
        assert f"English: {row['doc']['source']}" in prompt and prompt.endswith(":") and "translation only" in prompt
        lp, hyp, ref = row["chrf"]
        assert (lp, ref) == (row["doc"]["lp"], row["doc"]["target"])
        per_pair[lp] = sacrebleu.corpus_chrf([hyp], [[ref]]).score
    got = results["apertus_wmt24pp"]
    for lp, value in per_pair.items():
        assert got[f"chrf_{lp.replace('-', '_')},none"] == pytest.approx(value)
    assert got["chrf,none"] == pytest.approx(sum(per_pair.values()) / 3)


def test_bfcl_tools_reach_the_developer_block(vllm_server: VLLMServer) -> None:
    """What the BFCL requests carry renders the tools where the template declares them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bfcl_utils", PACKAGE_TASKS / "bfcl_v3" / "utils.py")
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
