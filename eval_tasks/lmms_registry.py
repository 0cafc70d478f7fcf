"""Entry point of the ``lmms_eval.models`` group: the manifest of the ``apertus`` model.

lmms-eval loads this while it builds its model registry, so it only names the class; the class
itself (:class:`eval_tasks.lmms_model.Apertus`) is imported when a run asks for ``--model apertus``.
"""

from __future__ import annotations

from typing import Any


def manifests() -> list[Any]:
    """The model manifests lmms-eval registers (``apertus``, a chat model: messages in)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return [ModelManifest(model_id="apertus", chat_class_path="eval_tasks.lmms_model.Apertus",
                          aliases=("apertus_vllm",))]
