"""IFEval through the chat template: upstream lm-eval's checkers on the visible answer."""

from __future__ import annotations

from typing import Any

from lm_eval.tasks.ifeval.utils import agg_inst_level_acc
from lm_eval.tasks.ifeval.utils import process_results as _ifeval_results

from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import answer_of, with_degeneration

__all__ = ["agg_inst_level_acc", "load", "process_results"]

TASK = "apertus_ifeval_chat"


def load(**kwargs: Any):
    """The ``train`` split (IFEval's only one): ``APERTUS_EVAL_DATA_IFEVAL``, else google/IFEval."""
    return load_splits(TASK, "ifeval", ["train"], hub="google/IFEval")


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """Upstream's four accuracies on the answer with the thinking span stripped, and ``degenerate``."""
    return with_degeneration(results[0], _ifeval_results(doc, [answer_of(results[0])]))
