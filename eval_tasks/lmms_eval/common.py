"""Wrap an upstream lmms-eval task under a unique name, reading a local copy of its data.

A task YAML here names its upstream base (``upstream: chartqa/chartqa.yaml``, relative to
``lmms_eval/tasks``), the local dataset (``apertus_data``: the dataset ``key`` of
:mod:`eval_tasks.data`, its image and audio columns) and what it changes (typically the report's
output budget). :class:`ApertusTask` loads the upstream YAML with lmms-eval's own loader, applies
the changes and reads the local copy when one is set (else the upstream hub dataset). Audio stays
undecoded (``{"bytes", "path"}``) for the ``apertus`` model, which resamples it to 24 kHz itself.

The tasks are lmms-eval 0.7 chat tasks (``ConfigurableMessagesTask``): a request carries the
document's messages (its images and clips, then its text), which every chat model of lmms-eval
reads; undecoded audio becomes an ``audio`` part (upstream would take a dict for a video).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eval_tasks import require
from eval_tasks.data import load_split, local_path

require("lmms_eval")

from lmms_eval.api.task import ConfigurableMessagesTask  # noqa: E402

__all__ = ["AUDIO_EXTENSIONS", "ApertusTask", "is_audio", "upstream_config"]

#: File extensions read as audio when a visual is a path (or a dict with only a path).
AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm")


def is_audio(visual: Any) -> bool:
    """An audio clip as datasets gives it: ``{"array", "sampling_rate"}``, ``{"bytes", "path"}`` or a path."""
    if isinstance(visual, dict):
        return any(k in visual for k in ("array", "sampling_rate", "bytes")) or \
            str(visual.get("path") or "").lower().endswith(AUDIO_EXTENSIONS)
    if isinstance(visual, (str, Path)):
        return str(visual).lower().endswith(AUDIO_EXTENSIONS)
    return False

_OWN_KEYS = ("class", "upstream", "apertus_data", "apertus_drop")


def upstream_config(relative: str) -> dict[str, Any]:
    """The fully resolved config of an upstream task YAML (``!function`` and ``include`` resolved)."""
    import lmms_eval.tasks
    from lmms_eval.utils import load_yaml_config

    path = Path(lmms_eval.tasks.__file__).parent / relative
    if not path.is_file():
        raise FileNotFoundError(f"upstream lmms-eval task {relative} is missing from this lmms-eval ({path})")
    return load_yaml_config(str(path), mode="full")


class ApertusTask(ConfigurableMessagesTask):
    """An upstream task under the name, data setting and budget of its ``apertus_*`` YAML (a chat task)."""

    @classmethod
    def _visual_to_content(cls, visual: Any) -> dict[str, Any]:
        if is_audio(visual):
            return {"type": "audio", "url": visual}
        return super()._visual_to_content(visual)

    def __init__(self, config: dict[str, Any] | None = None, model_name: str | None = None, **kwargs: Any) -> None:
        own = dict(config or {})
        if "upstream" not in own:
            raise ValueError(f"task {own.get('task')}: an apertus lmms-eval task names its upstream YAML (upstream:)")
        base = upstream_config(own["upstream"])
        for key in ("task", "tag", "group"):
            base.pop(key, None)
        for key in own.get("apertus_drop", []):
            base.pop(key, None)
        data = dict(own.get("apertus_data") or {})
        merged = {**base, **{k: v for k, v in own.items() if k not in _OWN_KEYS}}
        self._apertus_data = data
        super().__init__(config=merged, model_name=model_name)

    def download(self, dataset_kwargs: dict[str, Any] | None = None) -> None:
        import datasets

        data = self._apertus_data
        task = self.config.task
        key = data.get("key")
        where = local_path(task, key, required=bool(data.get("required")), why=data.get("why", "")) if key else None
        if where is None:
            return super().download(dataset_kwargs)
        images, audios = list(data.get("images", [])), list(data.get("audios", []))
        splits = [s for s in (self.config.test_split, self.config.validation_split, self.config.training_split,
                              self.config.fewshot_split) if s]
        loaded = {}
        for split in dict.fromkeys(splits):
            ds = load_split(task, key, split, config=self.config.dataset_name, media_columns=images + audios)
            for col in images:
                if col in ds.column_names and not isinstance(ds.features[col], datasets.Image):
                    ds = ds.cast_column(col, datasets.Image())
            for col in audios:  # paths or decoded features become undecoded {"bytes", "path"}
                if col in ds.column_names:
                    ds = ds.cast_column(col, datasets.Audio(decode=False))
            loaded[split] = ds
        self.dataset = datasets.DatasetDict(loaded)
        if self.config.process_docs is not None:
            for split in self.dataset:
                self.dataset[split] = self.config.process_docs(self.dataset[split])
        self.dataset_no_image = datasets.DatasetDict({
            split: ds.remove_columns([c for c in images + audios if c in ds.column_names])
            for split, ds in self.dataset.items()})
