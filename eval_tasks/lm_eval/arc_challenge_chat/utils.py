"""ARC-Challenge through the chat template, scored on the extracted option letter."""

from __future__ import annotations

import string
from typing import Any

from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import mc_prompt, score_choice

TASK = "apertus_arc_challenge_chat"


def load(**kwargs: Any):
    """The ``test`` split: ``APERTUS_EVAL_DATA_ARC_CHALLENGE``, else allenai/ai2_arc ARC-Challenge."""
    return load_splits(TASK, "arc_challenge", ["test"], config="ARC-Challenge", hub="allenai/ai2_arc")


def _options(doc: dict[str, Any]) -> list[str]:
    return list(doc["choices"]["text"])


def doc_to_text(doc: dict[str, Any]) -> str:
    return mc_prompt(doc["question"], _options(doc))


def doc_to_target(doc: dict[str, Any]) -> str:
    labels = [str(x) for x in doc["choices"]["label"]]
    return string.ascii_uppercase[labels.index(str(doc["answerKey"]))]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return score_choice(results[0], _options(doc), doc_to_target(doc))
