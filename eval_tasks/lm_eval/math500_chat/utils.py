"""MATH-500 through the chat template, the boxed answer checked with Math-Verify."""

from __future__ import annotations

from typing import Any

from apertus_plugins.posttrain.evaluation import extract_boxed, strip_thinking
from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import with_degeneration

TASK = "apertus_math500_chat"
INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


def load(**kwargs: Any):
    """The ``test`` split: ``APERTUS_EVAL_DATA_MATH500``, else HuggingFaceH4/MATH-500."""
    return load_splits(TASK, "math500", ["test"], hub="HuggingFaceH4/MATH-500")


def doc_to_text(doc: dict[str, Any]) -> str:
    return f"{INSTRUCTION}\n\n{doc['problem'].strip()}"


def doc_to_target(doc: dict[str, Any]) -> str:
    return str(doc["answer"])


def is_equivalent(answer: str, gold: str) -> bool:
    """Math-Verify equivalence of a final answer and the reference (both as LaTeX)."""
    from math_verify import parse, verify

    want = parse(f"${gold}$")
    got = parse(f"${answer}$")
    return bool(want) and bool(got) and bool(verify(want, got))


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    answer = extract_boxed(strip_thinking(results[0]))
    correct = answer is not None and is_equivalent(answer, doc_to_target(doc))
    return with_degeneration(results[0], {"math_verify": float(correct)})
