"""SwitzerlandQA in its published structure: one configuration per language (``English``,
``German``, ``French``, ``Italian``, ``Romansh``), a ``test`` split with ``question``,
``option_a`` … ``option_d``, the ``answer`` letter and the ``topic``.

The dataset is gated, so it is never downloaded: the tasks read a local copy laid out as
``<folder>/<Language>/test.{jsonl,json,parquet}`` (or a ``save_to_disk`` folder per language), the
folder given by ``APERTUS_EVAL_DATA_SWITZERLAND_QA`` (or ``APERTUS_EVAL_DATA/switzerland_qa``).
"""

from __future__ import annotations

from typing import Any

from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import mc_prompt, score_choice

KEY = "switzerland_qa"
LANGUAGES = {"en": "English", "de": "German", "fr": "French", "it": "Italian", "rm": "Romansh"}
TOPICS = ("geography", "history", "political_life", "social_life", "insurance")
INSTRUCTION = ("Answer the following multiple-choice question. Answer concisely and finish with "
               "\"The answer is (X)\", where X is the letter of the correct option.")


def load(language: str = "", **kwargs: Any):
    """The ``test`` split of one language's configuration."""
    task = f"apertus_switzerland_qa_{language}"
    if language not in LANGUAGES:
        raise ValueError(f"task {task}: unknown language {language!r}; known: {', '.join(LANGUAGES)}")
    return load_splits(task, KEY, ["test"], config=LANGUAGES[language],
                       why="SwitzerlandQA is gated and is not downloaded")


def options(doc: dict[str, Any]) -> list[str]:
    return [doc[f"option_{c}"] for c in "abcd"]


def doc_to_text(doc: dict[str, Any]) -> str:
    return mc_prompt(doc["question"], options(doc), INSTRUCTION)


def doc_to_target(doc: dict[str, Any]) -> str:
    return str(doc["answer"]).strip().strip("()").upper()


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return score_choice(results[0], options(doc), doc_to_target(doc))
