"""The Apertus protocol over an upstream lm-eval task: the class of the derived ``apertus_*`` tasks.

A derived task is upstream's own YAML (``include:``) under an ``apertus_`` name, with the
protocol's generation settings (the chat template's thinking flag, the budgets and sampling of
SPEC.md 7, the Apertus stops) and this class (``class: !function eval_tasks.lm_eval.protocol.ApertusTask``),
which changes three things and leaves upstream's prompts, extraction and metrics alone:

- every filter pipeline of the task starts with :class:`StripThinking`: upstream's answer
  extraction reads the visible answer (the thinking span removed in both surface forms; an
  unclosed span leaves nothing to extract);
- ``degenerate`` is reported beside the task's own metrics: the share of generations (thinking
  included) that repeat themselves (:func:`apertus_plugins.posttrain.evaluation.degeneration`);
- mean@k: with ``repeats: k`` (the thinking variants: 8 runs for AIME, 4 for other math and
  coding), upstream's scoring runs on each of the k answers and the item's score is their mean,
  where lm-eval alone would score the first one (its ``take_first`` filter).

:func:`load_dataset` is the derived tasks' ``custom_dataset``: the local copy of the dataset
(:mod:`eval_tasks.data`) when one is set, else upstream's hub dataset exactly as upstream loads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from apertus_plugins.posttrain.evaluation import degeneration, mean_over_repeats, strip_thinking

from .. import require

require("lm_eval")

from lm_eval.api.filter import Filter  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402

__all__ = ["ApertusTask", "StripThinking", "load_dataset", "protocol_filters"]


class StripThinking(Filter):
    """The visible answer of each generation: the thinking span removed (both surface forms)."""

    def apply(self, resps: Any, docs: Any) -> list[list[Any]]:
        return [[strip_thinking(r) if isinstance(r, str) else r for r in rs] for rs in resps]


def _is_take_first(step: dict[str, Any]) -> bool:
    return step.get("function") == "take_first"


def protocol_filters(filter_list: list[dict[str, Any]] | None, repeats: int) -> tuple[list[dict[str, Any]], bool]:
    """Upstream's filter pipelines with :class:`StripThinking` first (a ``none`` pipeline when upstream
    has none); with repeats, without ``take_first`` so every answer reaches the scoring. Returns the
    pipelines and whether upstream picked the first answer (the shape one answer is scored in)."""
    pipelines = filter_list or [{"name": "none", "filter": [{"function": "take_first"}]}]
    took_first = any(_is_take_first(step) for p in pipelines for step in p.get("filter", []))
    out = []
    for p in pipelines:
        steps = [dict(step) for step in p.get("filter", []) if not (repeats > 1 and _is_take_first(step))]
        out.append({**p, "filter": [{"function": StripThinking}, *steps]})
    return out, took_first


class ApertusTask(ConfigurableTask):
    """An upstream lm-eval task under the Apertus protocol (see the module docstring)."""

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # lm-eval hands a Python task its whole YAML, the ``class`` key included
        cfg = {k: v for k, v in (config or {}).items() if k != "class"}
        self._repeats = int(cfg.get("repeats") or 1)
        cfg["filter_list"], self._took_first = protocol_filters(cfg.get("filter_list"), self._repeats)
        self._degenerate: dict[int, float] = {}
        self._doc_id: int | None = None
        super().__init__(config=cfg, **kwargs)

    def apply_filters(self) -> Any:
        for inst in self._instances or []:
            texts = [r for r in inst.resps if isinstance(r, str)]
            if texts:
                self._degenerate[inst.doc_id] = sum(degeneration(t).degenerate for t in texts) / len(texts)
        return super().apply_filters()

    def doc_iterator(self, *args: Any, **kwargs: Any) -> Iterator[tuple[int, Any]]:
        # lm-eval scores each document right after this yields it: remember which one it is
        for doc_id, doc in super().doc_iterator(*args, **kwargs):
            self._doc_id = doc_id
            yield doc_id, doc

    def process_results(self, doc: dict[str, Any], results: list[Any]) -> dict[str, Any]:
        if self._repeats > 1 and len(results) == 1 and isinstance(results[0], list):
            one = (lambda r: [r]) if self._took_first else (lambda r: [[r]])
            scores = mean_over_repeats([super(ApertusTask, self).process_results(doc, one(r)) for r in results[0]])
        else:
            scores = super().process_results(doc, results)
        self._register(scores)
        degenerate = self._degenerate.get(self._doc_id) if self._doc_id is not None else None
        return {**scores, "degenerate": float(degenerate or 0.0)}

    def _register(self, scores: dict[str, Any]) -> None:
        """A metric the task's list does not name (RULER's score at a length of the run's choosing) is
        aggregated like the task's first metric."""
        known = self._aggregation_list
        first = next(iter(known), None)
        for key in scores:
            if key not in known and first is not None:
                known[key] = known[first]
                self._higher_is_better[key] = self._higher_is_better.get(first, True)

    def aggregation(self) -> dict[str, Any]:
        from lm_eval.api.metrics import mean

        return {**super().aggregation(), "degenerate": mean}

    def higher_is_better(self) -> dict[str, bool]:
        return {**super().higher_is_better(), "degenerate": False}


def load_dataset(apertus_dataset: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """The derived task's dataset: the local copy of ``apertus_dataset['key']`` when one is set
    (:mod:`eval_tasks.data`: its evaluated split, and the task's other splits, empty where the copy
    has none: a few-shot task whose shots come from a split needs that split), else
    ``datasets.load_dataset(path, name, **dataset_kwargs)`` as upstream does."""
    import datasets

    from eval_tasks.data import DataPathError, load_split, local_path

    spec = dict(apertus_dataset or {})
    task = spec.get("task", "an apertus task")
    key, path, name = spec.get("key"), spec.get("path"), spec.get("name")
    if not key or not path:
        raise ValueError(f"task {task}: the derived task names no dataset (apertus_dataset); regenerate it with "
                         "apertus eval-path lm_eval")
    if local_path(task, key, required=False) is None:
        upstream_kwargs = {k: v for k, v in (spec.get("kwargs") or {}).items() if k != "trust_remote_code"}
        return datasets.load_dataset(path=path, name=name, **upstream_kwargs)
    splits = list(spec.get("splits") or ["test"])
    loaded = {splits[0]: load_split(task, key, splits[0], config=name)}  # the evaluated split must be there
    for split in splits[1:]:  # the others (few-shot sources, unused splits): empty when the copy lacks them
        try:
            loaded[split] = load_split(task, key, split, config=name)
        except DataPathError as exc:
            if "no data for split" not in str(exc):
                raise
            loaded[split] = loaded[splits[0]].select([])
    return datasets.DatasetDict(loaded)
