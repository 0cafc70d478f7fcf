"""Shared pieces of the Apertus lm-eval tasks: prompts, scoring with the degeneration metric.

Imported by the ``utils.py`` beside each task YAML; the protocol facts come from
:mod:`apertus_plugins.posttrain.evaluation`.
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from typing import Any

from apertus_plugins.posttrain.evaluation import degeneration, extract_choice
from apertus_plugins.posttrain.judges import JudgeError, OpenAIJudge
from eval_tasks.catalogue import JUDGE_KEY_ENV, JUDGE_MODEL_ENV, JUDGE_TOP_ENV, JUDGE_URL_ENV

from .. import require

require("lm_eval")

__all__ = ["mc_prompt", "score_choice", "with_degeneration"]

MC_INSTRUCTION = ("Answer the following multiple-choice question. Think step by step, then finish with "
                  "\"The answer is (X)\", where X is the letter of the correct option.")


def mc_prompt(question: str, options: Sequence[str], instruction: str = MC_INSTRUCTION) -> str:
    """A zero-shot chain-of-thought multiple-choice prompt: instruction, question, lettered options."""
    lines = [instruction, "", question.strip(), ""]
    lines += [f"({string.ascii_uppercase[k]}) {str(o).strip()}" for k, o in enumerate(options)]
    return "\n".join(lines)


def with_degeneration(response: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` plus ``degenerate`` (1.0 when the whole response, thinking included, degenerates)."""
    return {**metrics, "degenerate": float(degeneration(response).degenerate)}


def score_choice(response: str, options: Sequence[str], gold: str) -> dict[str, Any]:
    """``exact_match`` of the extracted option letter against ``gold``, and ``degenerate``."""
    got = extract_choice(response, options=list(options))
    return with_degeneration(response, {"exact_match": float(got == gold)})


class JudgeSettingError(RuntimeError):
    """The judge of a task is not configured or does not answer; the message names the task and the setting."""


def named_judge(task: str, **settings: Any) -> OpenAIJudge:
    """The judge the user names for ``task`` (``APERTUS_EVAL_JUDGE_URL``, ``_MODEL``, ``_API_KEY``,
    ``_TOP_LOGPROBS``: :mod:`eval_tasks.catalogue`'s names), built with the task's ``settings`` (its
    templates, charter, aspect) and checked to answer and serve the model, so that a bad setting fails
    before any generation; :class:`JudgeSettingError` names the task and the setting otherwise."""
    url = os.environ.get(JUDGE_URL_ENV, "").strip()
    if not url:
        raise JudgeSettingError(f"task {task}: no judge; set {JUDGE_URL_ENV} to an OpenAI-compatible /v1 URL")
    model = os.environ.get(JUDGE_MODEL_ENV, "").strip()
    if not model:
        raise JudgeSettingError(f"task {task}: no judge model; set {JUDGE_MODEL_ENV} to the judge's served model name")
    try:
        judge = OpenAIJudge(base_url=url, model=model, api_key=os.environ.get(JUDGE_KEY_ENV, "").strip() or None,
                            top_logprobs=int(os.environ.get(JUDGE_TOP_ENV, "20")), **settings)
        judge.check()
    except (JudgeError, ValueError) as exc:
        raise JudgeSettingError(f"task {task}: the judge given by {JUDGE_URL_ENV}={url} ({JUDGE_MODEL_ENV}={model}) "
                                f"cannot be used: {exc}") from exc
    return judge
