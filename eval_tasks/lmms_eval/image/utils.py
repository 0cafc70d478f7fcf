"""Image tasks: upstream ChartQA, DocVQA, GQA, MMMU and AI2D under ``apertus_`` names.

AI2D is scored with the prose-tolerant option extractor of the core (the report's fix: the model
often answers with the option's text or a sentence, not a bare letter). GQA joins its images
from the local ``testdev_balanced_images`` configuration when a local copy is set.
"""

from __future__ import annotations

import string
from typing import Any

from apertus_plugins.posttrain.evaluation import extract_choice
from eval_tasks.data import load_split, local_path
from eval_tasks.lmms_eval.common import ApertusTask

__all__ = ["ApertusTask", "ai2d_process_results", "gqa_process_docs"]


def ai2d_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``exact_match``: the option letter extracted from a letter, a sentence or the option's text."""
    options = list(doc["options"])
    gold = string.ascii_uppercase[int(doc["answer"])]
    return {"exact_match": float(extract_choice(results[0], options=options) == gold)}


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
