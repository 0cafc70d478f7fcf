"""AlpacaEval 2 (report Table L.1: "AlpacaEval 2, length-controlled win rate"; Table L.3 reports it).

Each answer (thinking stripped) to an AlpacaEval instruction is compared with AlpacaEval's GPT-4
reference output (``alpaca_eval_gpt4_baseline``: GPT-4 Turbo's answers, AlpacaEval 2's baseline) by
the judge the user names, through the project's judge client
(:meth:`apertus_plugins.posttrain.judges.OpenAIJudge.preference`: the judge's probability that the
answer is the better one, read from its log-probabilities, both presentation orders averaged). The
report's judge is GPT-4.1; ours is any OpenAI-compatible judge that returns log-probabilities.

The scores come from the ``alpaca-eval`` package, used as a library:

- ``win_rate``: :func:`alpaca_eval.metrics.winrate.get_winrate` over the judge's preferences;
- ``lc_win_rate``: the length-controlled win rate, the win rate the judge would give if both answers
  had the same length. AlpacaEval 2's own GLM
  (:func:`alpaca_eval.metrics.get_length_controlled_winrate`, ``length_controlled_v1``: length term,
  instruction difficulty, regularised towards its gamed baselines) needs two files of AlpacaEval's hub
  dataset (``df_gamed.csv``, ``instruction_difficulty.csv``), fetched by the package or found in the
  hub cache. Without them (an offline machine) the same package's GLM pieces fit its
  ``length_controlled_minimal`` formula (length term and intercept) instead, and a warning says so;
- ``lc_full_glm``: 1 when AlpacaEval 2's own GLM was fitted, 0 for the minimal one.

Lengths are counted in characters, as AlpacaEval counts them. The instruction's ``index`` (its place
in AlpacaEval's 805 instructions) keys the instruction difficulty.

Settings (environment; the names are :mod:`eval_tasks.catalogue`'s):

- ``APERTUS_EVAL_JUDGE_URL``: the judge's ``/v1`` URL (required);
- ``APERTUS_EVAL_JUDGE_MODEL``: the judge's served model name (required);
- ``APERTUS_EVAL_JUDGE_API_KEY``: its API key, where it needs one;
- ``APERTUS_EVAL_JUDGE_TOP_LOGPROBS``: alternatives read for the verdict token (default 20);
- the instructions and reference outputs: ``APERTUS_EVAL_DATA_ALPACA_EVAL`` (or
  ``APERTUS_EVAL_DATA/alpaca_eval``), a copy of AlpacaEval's hub dataset (``tatsu-lab/alpaca_eval``:
  ``alpaca_eval_gpt4_baseline.json`` with ``instruction`` and ``output``); without one that file is
  downloaded from the hub.

The judge is checked when the task loads, so an unreachable judge fails before any generation.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from functools import cache
from typing import Any

from apertus_plugins.posttrain.evaluation import strip_thinking
from apertus_plugins.posttrain.judges import PROMPT_SECTION, JudgeError, OpenAIJudge
from eval_tasks.catalogue import JUDGE_URL_ENV
from eval_tasks.data import DataPathError, load_split, local_path, setting_name
from eval_tasks.lm_eval.common import JudgeSettingError, named_judge, with_degeneration

TASK = "apertus_alpacaeval2"
#: AlpacaEval's hub dataset and the file of its GPT-4 reference outputs (AlpacaEval 2's baseline)
HUB, REFERENCE = "tatsu-lab/alpaca_eval", "alpaca_eval_gpt4_baseline"
#: the names alpaca-eval's annotations carry (the baseline is ``output_1``, the model ``output_2``)
BASELINE_NAME, MODEL_NAME = "gpt4_1106_preview", "apertus"
ASPECT = "the quality of the answer to the instruction, as a person would judge it"
#: the judge's pairwise prompt: AlpacaEval's question (which output is better, from a human perspective)
#: in the form the project's judge reads (a verdict digit and its log-probabilities)
PAIRWISE_TEMPLATE = "\n\n".join([
    "You compare two assistant responses to the same instruction and select the better one: the response a "
    "person would prefer for {aspect}: helpful, accurate, relevant and complete.",
    PROMPT_SECTION,
    "{response}",
    "Answer with a single digit, 1 or 2, and nothing else.",
])
_log = logging.getLogger(__name__)


@cache
def judge() -> OpenAIJudge:
    """The task's judge, built from the environment and checked once."""
    return named_judge(TASK, pairwise_template=PAIRWISE_TEMPLATE, feedback_template="{prompt}",
                       rating_template="{prompt}", aspect=ASPECT)


def _reference_outputs() -> Any:
    """AlpacaEval's instructions with the GPT-4 reference outputs: the local copy, else the hub's file."""
    if local_path(TASK, "alpaca_eval", required=False) is not None:
        return load_split(TASK, "alpaca_eval", REFERENCE, hub=HUB)
    import datasets
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(HUB, f"{REFERENCE}.json", repo_type="dataset")
    except OSError as exc:  # offline, or the hub cannot be reached: say which setting gives a local copy
        raise DataPathError(f"task {TASK}: no local AlpacaEval data and {REFERENCE}.json of {HUB} cannot be had from "
                            f"the hub ({exc}); set {setting_name('alpaca_eval')} to a copy of {HUB}") from exc
    return datasets.load_dataset("json", data_files=[path], split="train")


def load(**kwargs: Any) -> Any:
    """The instructions and reference outputs (split ``eval``, each with its ``index`` among AlpacaEval's);
    checks the judge first so a bad setting fails before generation."""
    import datasets

    judge()
    data = _reference_outputs()
    missing = {"instruction", "output"} - set(data.column_names)
    if missing:
        raise DataPathError(f"task {TASK}: the AlpacaEval data lack the column(s) {sorted(missing)}: each instruction "
                            f"needs AlpacaEval's reference output ({REFERENCE}, see the module docstring)")
    if "index" not in data.column_names:
        data = data.add_column("index", list(range(len(data))))
    return datasets.DatasetDict({"eval": data})


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """Per instruction: the judge's preference for the answer over the reference output, with both texts
    (``lc_win_rate``, ``lc_full_glm``), the preference (``win_rate``) and ``degenerate``."""
    response = results[0]
    answer, reference = strip_thinking(response), str(doc["output"])
    try:
        preference = judge().preference(str(doc["instruction"]), answer, reference)
    except JudgeError as exc:
        raise JudgeSettingError(f"task {TASK}: the judge given by {JUDGE_URL_ENV} failed: {exc}") from exc
    item = (int(doc["index"]), float(preference), answer, reference)
    return with_degeneration(response, {"lc_win_rate": item, "lc_full_glm": item, "win_rate": float(preference)})


def annotations(items: Sequence[Sequence[Any]]) -> Any:
    """alpaca-eval's annotations of ``(index, preference, answer, reference)`` items: ``preference`` in
    [1, 2] (2: the model's answer wins), the reference as ``output_1``, the answer as ``output_2``."""
    import pandas as pd

    return pd.DataFrame([{"index": int(i), "instruction": int(i), "output_1": str(ref), "output_2": str(ans),
                          "generator_1": BASELINE_NAME, "generator_2": MODEL_NAME, "annotator": "judge",
                          "preference": 1.0 + float(p)} for i, p, ans, ref in items])


def _alpaca_eval() -> tuple[Any, Any]:
    """alpaca-eval's metrics and its GLM module (importing the package warns about pkg_resources)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from alpaca_eval import metrics
        from alpaca_eval.metrics import glm_winrate

    return metrics, glm_winrate


def _minimal_glm(df: Any, glm: Any) -> float:
    """The length-controlled win rate under alpaca-eval's ``length_controlled_minimal`` formula (its design
    matrix and its logistic fit on the soft preferences): the predicted preference at zero length difference."""
    import numpy as np
    import pandas as pd

    delta = (df["output_2"].str.len() - df["output_1"].str.len()).astype(float)
    scale = float(delta.std()) if len(delta) > 1 else 0.0
    train = pd.DataFrame({"preference": df["preference"] - 1.0,
                          "std_delta_len": delta / scale if scale > 0 and np.isfinite(scale) else 0.0 * delta,
                          "not_gamed_baseline": True})
    test = pd.DataFrame({"not_gamed_baseline": [True] * len(df), "std_delta_len": [0.0] * len(df)})
    x_train, x_test = glm.make_dmatrix_for_model(train, test, formula=glm.GLM_INFO["length_controlled_minimal"]["formula"])
    model = glm.fit_LogisticRegressionCV(x_train, "preference", is_ytrue_proba=True,
                                         n_splits=min(5, len(df)) if len(df) > 1 else 0)
    return float(model.predict_proba(x_test)[:, 1].mean())


@cache
def _length_controlled(items: tuple[tuple[Any, ...], ...]) -> tuple[float, bool]:
    """``(length-controlled win rate in [0, 1], whether AlpacaEval 2's own GLM was fitted)``."""
    if not items:
        raise ValueError(f"task {TASK}: no judged answers to compute a win rate from")
    metrics_module, glm = _alpaca_eval()
    df = annotations(items)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn's deprecations inside alpaca-eval's fit
        try:
            metrics = metrics_module.get_length_controlled_winrate(df, save_weights_dir=None,
                                                                   is_warn_extreme_changes=False)
            return float(metrics["length_controlled_winrate"]) / 100.0, True
        except OSError as exc:  # huggingface_hub's errors when AlpacaEval's GLM files cannot be had (offline)
            _log.warning("task %s: AlpacaEval 2's GLM files (df_gamed.csv, instruction_difficulty.csv of %s) are not "
                         "available (%s); the length-controlled win rate is fitted with alpaca-eval's "
                         "length_controlled_minimal formula (length term only)", TASK, HUB, exc)
        return _minimal_glm(df, glm), False


def _key(items: Sequence[Sequence[Any]]) -> tuple[tuple[Any, ...], ...]:
    return tuple(tuple(item) for item in items)


def lc_win_rate(items: Sequence[Sequence[Any]]) -> float:
    """The length-controlled win rate of the items' ``(index, preference, answer, reference)``."""
    return _length_controlled(_key(items))[0]


def lc_full_glm(items: Sequence[Sequence[Any]]) -> float:
    """1.0 when the length-controlled win rate is AlpacaEval 2's own GLM, 0.0 for the minimal formula."""
    return float(_length_controlled(_key(items))[1])


def win_rate(preferences: Sequence[float]) -> float:
    """alpaca-eval's win rate of the judge's preferences (in [0, 1])."""
    metrics, _ = _alpaca_eval()
    return float(metrics.get_winrate([{"preference": 1.0 + float(p)} for p in preferences])["win_rate"]) / 100.0
