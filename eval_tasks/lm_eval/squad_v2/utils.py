"""SQuAD v2 (Rajpurkar et al., 2018) scored by the official SQuAD 2.0 rule, written here (no hub metric).

The questions are the ``validation`` split of ``rajpurkar/squad_v2`` (``id``, ``title``, ``context``,
``question``, ``answers`` with ``text`` and ``answer_start``), all of them: answerable and unanswerable
(``answers.text`` empty), as the official evaluation scores them. A local copy is read from
``APERTUS_EVAL_DATA_SQUAD_V2`` (or ``APERTUS_EVAL_DATA/squad_v2``), else the hub's.

How the model says "no answer": the prompt asks for :data:`UNANSWERABLE` when the passage does not
contain the answer; that reply (any case, punctuation or surrounding words such as ``Answer:`` aside:
see :func:`extract_answer`) is the empty answer of the official rule. The answer read is the first
non-empty line of the visible reply (the thinking span stripped), without an ``Answer:`` prefix,
quotes or emphasis.

The official rule (``evaluate-v2.0.py``): an answer is normalised (lower case, punctuation dropped, the
articles a/an/the dropped, whitespace collapsed); exact match is equality of the normalised answers,
F1 the harmonic mean of token precision and recall over the normalised tokens; each is the maximum
over the gold answers. A question without a gold answer (or whose gold answers normalise to nothing)
has the empty answer as its gold: it scores 1 iff the prediction is empty, 0 otherwise.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

from apertus_plugins.posttrain.evaluation import strip_thinking
from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import with_degeneration

TASK = "apertus_squad_v2"
KEY = "squad_v2"
HUB = "rajpurkar/squad_v2"
#: the reply the prompt asks for when the passage does not contain the answer (scored as the empty answer)
UNANSWERABLE = "unanswerable"
INSTRUCTION = ("Answer the question from the passage with the shortest span of the passage that answers it, "
               f"and nothing else. If the passage does not contain the answer, reply \"{UNANSWERABLE}\".")

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)
_PREFIX = re.compile(r"^\s*(?:the\s+)?(?:final\s+)?answer\s*(?:is)?\s*[:\-]\s*", re.IGNORECASE)


def load(**kwargs: Any):
    """The ``validation`` split of SQuAD v2: the local copy when one is set, else the hub's."""
    return load_splits(TASK, KEY, ["validation"], hub=HUB)


def doc_to_text(doc: dict[str, Any]) -> str:
    return (f"{INSTRUCTION}\n\nTitle: {str(doc.get('title') or '').strip()}\n\nPassage: {str(doc['context']).strip()}"
            f"\n\nQuestion: {str(doc['question']).strip()}\n\nAnswer:")


def gold_answers(doc: dict[str, Any]) -> list[str]:
    """The gold answers of ``doc`` as the official rule reads them: ``[""]`` for an unanswerable question."""
    answers = doc.get("answers")
    texts = answers.get("text") if isinstance(answers, dict) else answers
    if texts is None or isinstance(texts, str):
        raise ValueError(f"task {TASK}, item {doc.get('id')!r}: answers must hold a list of texts, got {answers!r}")
    gold = [str(t) for t in texts if normalize_answer(str(t))]
    return gold or [""]


def doc_to_target(doc: dict[str, Any]) -> str:
    return gold_answers(doc)[0] or UNANSWERABLE


def normalize_answer(text: str) -> str:
    """Lower case, punctuation dropped, the articles a/an/the dropped, whitespace collapsed (the official rule)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _tokens(text: str) -> list[str]:
    return normalize_answer(text).split() if text else []


def exact(gold: str, pred: str) -> float:
    return float(normalize_answer(gold) == normalize_answer(pred))


def f1(gold: str, pred: str) -> float:
    """Token-overlap F1 of the normalised answers; two empty answers agree (1), one empty answer scores 0."""
    gold_toks, pred_toks = _tokens(gold), _tokens(pred)
    if not gold_toks or not pred_toks:
        return float(gold_toks == pred_toks)
    same = sum((Counter(gold_toks) & Counter(pred_toks)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def extract_answer(response: str) -> str:
    """The answer of a reply: the first non-empty line of its visible part, without an ``Answer:`` prefix,
    quotes or emphasis; :data:`UNANSWERABLE` (however written) becomes the empty answer."""
    visible = strip_thinking(response or "")
    line = next((ln.strip() for ln in visible.splitlines() if ln.strip()), "")
    line = _PREFIX.sub("", line).strip().strip("*_`\"'“”‘’").strip()
    if normalize_answer(line) in (UNANSWERABLE, f"{UNANSWERABLE} question", f"question is {UNANSWERABLE}"):
        return ""
    return line


def score(doc: dict[str, Any], response: str) -> dict[str, Any]:
    """Exact match and F1 of the reply's answer, each the maximum over the gold answers, and the same F1
    again under ``has_ans_f1`` or ``no_ans_f1`` (marked with whether the question is answerable)."""
    gold, pred = gold_answers(doc), extract_answer(response)
    best_f1 = max(f1(g, pred) for g in gold)
    answerable = gold != [""]
    return {"f1": best_f1, "exact_match": max(exact(g, pred) for g in gold),
            "has_ans_f1": (answerable, best_f1), "no_ans_f1": (not answerable, best_f1)}


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """The SQuAD 2.0 scores of the first answer, and ``degenerate`` (the whole response, thinking included)."""
    return with_degeneration(results[0], score(doc, results[0]))


def mean_where(items: Sequence[tuple[bool, float]]) -> float:
    """The mean of the values whose question is of the kind (answerable or not); 0 when there are none."""
    kept = [value for keep, value in items if keep]
    return sum(kept) / len(kept) if kept else 0.0
