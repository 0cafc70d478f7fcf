"""WMT24++ (news domain) scored by corpus chrF, the report's metric for Table 32.

The items are the ``train`` split (the only one) of each language pair's configuration of
``google/wmt24pp`` (``lp``, ``domain``, ``document_id``, ``segment_id``, ``is_bad_source``, ``source``,
``target``): the pairs :data:`PAIRS` (English into German, French and Italian: the report's focus
languages that WMT24++ holds), the ``news`` domain only, items with ``is_bad_source`` left out. A local
copy is read from ``APERTUS_EVAL_DATA_WMT24PP`` (or ``APERTUS_EVAL_DATA/wmt24pp``), one sub-folder per
configuration (``en-de_DE/train.jsonl``), else the hub's.

The prompt asks for the translation only; the hypothesis is the visible reply (the thinking span
stripped), stripped of surrounding whitespace. Each pair's score is sacrebleu's corpus chrF (character
6-grams, beta 2, 0-100) over that pair's items; ``chrf`` is the mean of the pairs' scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from apertus_plugins.posttrain.evaluation import strip_thinking
from eval_tasks.data import load_split
from eval_tasks.lm_eval.common import with_degeneration

TASK = "apertus_wmt24pp"
KEY = "wmt24pp"
HUB = "google/wmt24pp"
DOMAIN = "news"
#: the language pairs (hub configurations) and the target language's name in the prompt
PAIRS = {"en-de_DE": "German", "en-fr_FR": "French", "en-it_IT": "Italian"}
SOURCE_LANGUAGE = "English"

Item = tuple[str, str, str]  # (pair, hypothesis, reference)


def _kept(doc: dict[str, Any]) -> bool:
    return str(doc.get("domain") or "") == DOMAIN and not doc.get("is_bad_source")


def load(**kwargs: Any):
    """The news items of every pair (bad sources left out) as one ``test`` split, each with its ``lp``."""
    import datasets

    parts = []
    for pair in PAIRS:
        ds = load_split(TASK, KEY, "train", config=pair, hub=HUB)
        ds = ds.filter(_kept).map(lambda row, pair=pair: {"lp": pair})
        parts.append(ds.select_columns(["lp", "source", "target"]))
    return datasets.DatasetDict({"test": datasets.concatenate_datasets(parts)})


def target_language(doc: dict[str, Any]) -> str:
    pair = str(doc.get("lp") or "")
    if pair not in PAIRS:
        raise ValueError(f"task {TASK}: item language pair {pair!r} is not one of {sorted(PAIRS)}")
    return PAIRS[pair]


def doc_to_text(doc: dict[str, Any]) -> str:
    language = target_language(doc)
    return (f"Translate the following text from {SOURCE_LANGUAGE} into {language}. "
            f"Answer with the {language} translation only.\n\n{SOURCE_LANGUAGE}: {str(doc['source']).strip()}"
            f"\n\n{language}:")


def hypothesis(response: str) -> str:
    """The translation of a reply: its visible part, stripped of surrounding whitespace."""
    return strip_thinking(response or "").strip()


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """The (pair, hypothesis, reference) item of each chrF aggregation, and ``degenerate``."""
    target_language(doc)
    item: Item = (str(doc["lp"]), hypothesis(results[0]), str(doc["target"]))
    scores: dict[str, Any] = {"chrf": item}
    scores.update({f"chrf_{pair.replace('-', '_')}": item for pair in PAIRS})
    return with_degeneration(results[0], scores)


def corpus_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu's corpus chrF (0-100) of the hypotheses against one reference each."""
    import sacrebleu

    return float(sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score)


def chrf_of(items: Sequence[Item], pair: str) -> float:
    """Corpus chrF over the items of ``pair``; NaN when the pair has none."""
    kept = [(hyp, ref) for lp, hyp, ref in items if lp == pair]
    if not kept:
        return float("nan")
    return corpus_chrf([h for h, _ in kept], [r for _, r in kept])


def chrf_mean(items: Sequence[Item]) -> float:
    """The mean of the pairs' corpus chrF, over the pairs that have items."""
    scores = [chrf_of(items, pair) for pair in PAIRS if any(lp == pair for lp, _, _ in items)]
    return sum(scores) / len(scores) if scores else float("nan")


def chrf_en_de_DE(items: Sequence[Item]) -> float:
    return chrf_of(items, "en-de_DE")


def chrf_en_fr_FR(items: Sequence[Item]) -> float:
    return chrf_of(items, "en-fr_FR")


def chrf_en_it_IT(items: Sequence[Item]) -> float:
    return chrf_of(items, "en-it_IT")
