"""Charter alignment: an OpenAI-compatible judge that sees the charter rates each answer 0-9; the
score is the expected value under the judge's distribution over the rating tokens (the core's
judge client, :class:`apertus_plugins.posttrain.judges.OpenAIJudge`).

Settings (environment):

- ``APERTUS_EVAL_JUDGE_URL``: the judge's ``/v1`` URL (required);
- ``APERTUS_EVAL_JUDGE_MODEL``: the judge's served model name (required);
- ``APERTUS_EVAL_CHARTER``: the charter, a ``.txt``/``.md`` file (required: a score against any
  other text is meaningless);
- ``APERTUS_EVAL_JUDGE_TOP_LOGPROBS``: alternatives read for the rating token (default 20);
- the prompts: ``APERTUS_EVAL_DATA_CHARTER_ALIGNMENT`` (or ``APERTUS_EVAL_DATA/charter_alignment``),
  a ``test`` split with a ``prompt`` column.

The judge is checked when the task loads, so an unreachable judge fails before any generation.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from apertus_plugins.posttrain.evaluation import strip_thinking
from apertus_plugins.posttrain.judges import JudgeError, OpenAIJudge
from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import with_degeneration

TASK = "apertus_charter_alignment"
SCALE = (0, 9)
ASPECT = "alignment with the charter"
URL, MODEL, CHARTER, TOP = ("APERTUS_EVAL_JUDGE_URL", "APERTUS_EVAL_JUDGE_MODEL", "APERTUS_EVAL_CHARTER",
                            "APERTUS_EVAL_JUDGE_TOP_LOGPROBS")


class JudgeSettingError(RuntimeError):
    """The judge of the task is not configured or does not answer; the message names the setting."""


@cache
def judge() -> OpenAIJudge:
    """The task's judge, built from the environment and checked once."""
    url = os.environ.get(URL, "").strip()
    if not url:
        raise JudgeSettingError(f"task {TASK}: no judge; set {URL} to an OpenAI-compatible /v1 URL")
    charter = os.environ.get(CHARTER, "").strip()
    if not charter:
        raise JudgeSettingError(f"task {TASK}: no charter; set {CHARTER} to the charter's .txt or .md file")
    if not os.path.isfile(charter):
        raise JudgeSettingError(f"task {TASK}: the charter file {charter} given by {CHARTER} does not exist")
    model = os.environ.get(MODEL, "").strip()
    if not model:
        raise JudgeSettingError(f"task {TASK}: no judge model; set {MODEL} to the judge's served model name")
    try:
        j = OpenAIJudge(base_url=url, model=model, charter="@" + charter, scale=SCALE, aspect=ASPECT,
                        top_logprobs=int(os.environ.get(TOP, "20")))
        j.check()
    except JudgeError as exc:
        raise JudgeSettingError(f"task {TASK}: the judge given by {URL}={url} ({MODEL}={model}) cannot be used: "
                                f"{exc}") from exc
    return j


def load(**kwargs: Any):
    """The prompts (``test``); checks the judge first so a bad setting fails before generation."""
    judge()
    return load_splits(TASK, "charter_alignment", ["test"], why="the charter-alignment prompts are not on a hub")


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``charter_score`` (0-9 expected rating of the visible answer) and ``degenerate``."""
    response = results[0]
    try:
        score = judge().rate(doc["prompt"], strip_thinking(response))
    except JudgeError as exc:
        raise JudgeSettingError(f"task {TASK}: the judge given by {URL} failed: {exc}") from exc
    return with_degeneration(response, {"charter_score": score})
