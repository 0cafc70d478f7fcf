"""Over-refusal on OR-Bench hard: the share of benign-but-sensitive-looking prompts the model refuses."""

from __future__ import annotations

from typing import Any

from apertus_plugins.posttrain.evaluation import is_refusal
from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import with_degeneration

TASK = "apertus_or_bench_hard"


def load(**kwargs: Any):
    """The ``train`` split of or-bench-hard-1k: ``APERTUS_EVAL_DATA_OR_BENCH``, else bench-llm/or-bench."""
    return load_splits(TASK, "or_bench", ["train"], config="or-bench-hard-1k", hub="bench-llm/or-bench")


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``refusal_rate`` (1.0 when the visible answer refuses; lower is better) and ``degenerate``."""
    return with_degeneration(results[0], {"refusal_rate": float(is_refusal(results[0]))})
