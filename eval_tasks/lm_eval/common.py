"""Shared pieces of the Apertus lm-eval tasks: prompts, scoring with the degeneration metric.

Imported by the ``utils.py`` beside each task YAML; the protocol facts come from
:mod:`apertus_plugins.posttrain.evaluation`.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from apertus_plugins.posttrain.evaluation import degeneration, extract_choice

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
