"""VQA-RAD: the prompt and the scoring of this package's lmms-eval task (``vqa_rad.yaml``).

The report (Table 34, section 5.5) ran its image suite with its forks of lmms-eval and VLMEvalKit and
names no judge for VQA-RAD; its neighbour in the table, SLAKE, is lmms-eval's ``slake_en``, which asks
for "a single word or phrase" and scores every answer, open and closed, by exact match after a
normalisation. VQA-RAD is asked and scored the same way here (:func:`normalize`, :func:`is_correct`):

- lower case, text in parentheses dropped, punctuation made spaces, runs of spaces made one;
- ``yes``/``yeah``/``yep``/``true`` read as ``yes``, ``no``/``nope``/``false`` as ``no``; ``x ray`` as ``xray``;
- the normalised answer equals the normalised reference: correct; anything else (a sentence around the
  right word too) is wrong.

A question is closed when its reference answer is yes or no (the dataset has no answer-type field;
inspect-evals reads it the same way), open otherwise. inspect-evals' ``vqa_rad`` scores the closed ones
alike but grades the open ones with a judge model; that is not what is run here (the report names no
judge), so the open accuracy here is the stricter, judge-free one. The overall accuracy is the report's
number; the closed and open accuracies are reported beside it.
"""

from __future__ import annotations

import re
import string
from typing import Any

__all__ = ["CLOSED_ANSWERS", "METRICS", "accuracy", "answer_type", "closed_accuracy", "doc_to_text", "doc_to_visual",
           "is_correct", "normalize", "open_accuracy", "process_results"]

#: the reference answers of a closed question
CLOSED_ANSWERS = frozenset({"yes", "no"})
METRICS = ("vqa_rad_accuracy", "vqa_rad_closed_accuracy", "vqa_rad_open_accuracy")
_YES = frozenset({"yes", "yeah", "yep", "true"})
_NO = frozenset({"no", "nope", "false"})
_ALIASES = {"x ray": "xray"}
_PARENS = re.compile(r"\([^)]*\)")
_PUNCT = str.maketrans(dict.fromkeys(string.punctuation, " "))


def normalize(text: Any) -> str:
    """An answer as it is compared: see the module docstring (None is the empty answer)."""
    out = _PARENS.sub(" ", "" if text is None else str(text).strip().lower())
    out = " ".join(out.translate(_PUNCT).split())
    out = _ALIASES.get(out, out)
    return "yes" if out in _YES else "no" if out in _NO else out


def answer_type(reference: Any) -> str:
    """``closed`` for a yes/no reference answer, ``open`` otherwise."""
    return "closed" if normalize(reference) in CLOSED_ANSWERS else "open"


def is_correct(prediction: Any, reference: Any) -> bool:
    """Exact match of the normalised answers; an empty answer is never correct."""
    pred = normalize(prediction)
    return bool(pred) and pred == normalize(reference)


def doc_to_visual(doc: dict[str, Any]) -> list[Any]:
    """The question's one image, as RGB."""
    image = doc["image"]
    return [image.convert("RGB") if hasattr(image, "convert") else image]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{str(doc['question']).strip()}{kwargs.get('post_prompt', '')}"


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, dict[str, Any]]:
    """One record per metric: the reply, the reference, both normalised, the answer type and the verdict."""
    prediction = results[0] if results else ""
    record = {"question": doc["question"], "prediction": prediction, "target": doc["answer"],
              "prediction_normalized": normalize(prediction), "target_normalized": normalize(doc["answer"]),
              "answer_type": answer_type(doc["answer"]), "correct": is_correct(prediction, doc["answer"])}
    return dict.fromkeys(METRICS, record)


def _share(records: list[dict[str, Any]], kind: str | None = None) -> float:
    chosen = [r for r in records if kind is None or r["answer_type"] == kind]
    return sum(bool(r["correct"]) for r in chosen) / len(chosen) if chosen else 0.0


def accuracy(records: list[dict[str, Any]]) -> float:
    """The share of questions answered correctly (a fraction; the report's number)."""
    return _share(records)


def closed_accuracy(records: list[dict[str, Any]]) -> float:
    """The share of the closed (yes/no) questions answered correctly (0.0 when there are none)."""
    return _share(records, "closed")


def open_accuracy(records: list[dict[str, Any]]) -> float:
    """The share of the open questions answered correctly (0.0 when there are none)."""
    return _share(records, "open")
