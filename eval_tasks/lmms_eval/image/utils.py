"""Image tasks: what the derived ChartQA, DocVQA, GQA, MMMU, AI2D... need beyond upstream's config.

- AI2D is scored as the report's table scores it, by upstream's own rule (a bare option letter is
  credited, prose is not); :class:`ProseTolerantChoice` is the report's aside, a second filter
  pipeline (``prose-tolerant``) that reads the option from a letter, a sentence or the option's
  text (:func:`apertus_plugins.posttrain.evaluation.extract_choice`).
- GQA joins its images from the local ``testdev_balanced_images`` configuration when a local
  copy is set (:func:`gqa_process_docs`).
"""

from __future__ import annotations

from typing import Any

from apertus_plugins.posttrain.evaluation import extract_choice
from eval_tasks.data import load_split, local_path
from eval_tasks.lmms_eval.common import ApertusTask  # checks the lmms-eval version before lmms-eval loads

# isort: split
from lmms_eval.api.filter import Filter

__all__ = ["ApertusTask", "ProseTolerantChoice", "gqa_process_docs"]


class ProseTolerantChoice(Filter):
    """The option letter read from a letter, a sentence or the option's own text (None -> the reply as is)."""

    def __init__(self, options_field: str = "options", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.options_field = options_field

    def apply(self, resps: Any, docs: Any) -> list[Any]:
        # lmms-eval's chat tasks hand a filter the task's documents in order, as many as there are
        # responses or more (--limit): the k-th response answers the k-th document, as upstream's filters read it
        out = []
        for replies, doc in zip(resps, docs, strict=False):
            options = [str(o) for o in doc[self.options_field]]
            reply = replies[0] if isinstance(replies, list) else replies
            out.append(extract_choice(reply, options=options) or reply)
        return out


def gqa_process_docs(dataset: Any) -> Any:
    """Attach each question's image (from ``testdev_balanced_images``, local copy or hub)."""
    if local_path("apertus_gqa", "gqa", required=False) is None:
        from lmms_eval.tasks.gqa.utils import gqa_process_docs as upstream

        return upstream(dataset)
    images = load_split("apertus_gqa", "gqa", "testdev", config="testdev_balanced_images", media_columns=("image",))
    import datasets

    if not isinstance(images.features["image"], datasets.Image):
        images = images.cast_column("image", datasets.Image())
    by_id = {row["id"]: row["image"].convert("RGB") for row in images}
    missing = sorted(set(dataset["imageId"]) - set(by_id))
    if missing:
        raise KeyError(f"task apertus_gqa: images {missing[:5]} are missing from testdev_balanced_images")
    return dataset.map(lambda doc: {"image": by_id[doc["imageId"]]})
