"""MMLU, zero-shot chain of thought through the chat template, scored on the extracted letter."""

from __future__ import annotations

import string
from typing import Any

from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import mc_prompt, score_choice

TASK = "apertus_mmlu_chat"


def load(**kwargs: Any):
    """The ``test`` split: ``APERTUS_EVAL_DATA_MMLU`` (or ``APERTUS_EVAL_DATA/mmlu``), else cais/mmlu."""
    return load_splits(TASK, "mmlu", ["test"], hub="cais/mmlu", hub_config="all")


def doc_to_text(doc: dict[str, Any]) -> str:
    return mc_prompt(doc["question"], doc["choices"])


def doc_to_target(doc: dict[str, Any]) -> str:
    return string.ascii_uppercase[int(doc["answer"])]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return score_choice(results[0], doc["choices"], doc_to_target(doc))
