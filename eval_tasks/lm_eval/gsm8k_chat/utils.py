"""GSM8K, chain of thought through the chat template (8 shots as earlier turns), exact match on the number."""

from __future__ import annotations

import re
from typing import Any

from apertus_plugins.posttrain.evaluation import extract_number
from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import with_degeneration

TASK = "apertus_gsm8k_chat"
INSTRUCTION = "Solve the math problem step by step. Finish with \"The answer is N\", where N is the final number."


def load(**kwargs: Any):
    """``train`` (the shots) and ``test``: ``APERTUS_EVAL_DATA_GSM8K``, else openai/gsm8k main."""
    return load_splits(TASK, "gsm8k", ["train", "test"], config="main", hub="openai/gsm8k")


def doc_to_text(doc: dict[str, Any]) -> str:
    return f"{INSTRUCTION}\n\nQuestion: {doc['question'].strip()}"


def _gold(doc: dict[str, Any]) -> str:
    return doc["answer"].split("####")[-1].strip()


def doc_to_target(doc: dict[str, Any]) -> str:
    """The reference solution as a shot: its reasoning without calculator marks, then the answer."""
    reasoning = re.sub(r"<<[^>]*>>", "", doc["answer"].split("####")[0]).strip()
    return f"{reasoning}\nThe answer is {_gold(doc)}."


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    gold = extract_number(f"#### {_gold(doc)}")
    return with_degeneration(results[0], {"exact_match": float(extract_number(results[0]) == gold)})
