"""The media encoders as the pipeline uses them: loaded lazily per modality, batched by exact shape.

The encoders (:mod:`apertus_plugins.encoders`) never pad: a batch holds only items of one shape
(crop(T(pad(x))) != T(x)). The plan makes batches shape-uniform from headers; the worker still
groups the decoded arrays by their actual shape (:func:`apertus_plugins.encoders.group_by_shape`),
so an item whose decoded shape differs from its header's (a PNG whose EXIF block follows the
pixels) is encoded alone and correctly rather than padded.

Audio: the report's pipeline (section 2.3.2, SPEC.md 2.2) pads clips of different lengths to the
longest of their batch and drops the last five codes of every padded clip (they are unstable).
By default this pipeline never pads: clips share a batch only when their 24 kHz sample counts are
identical, so every clip is encoded exactly as on its own, keeps all ceil(samples / 600) codes,
and no code is dropped. The cost is smaller audio batches; the gain is codes that equal
single-clip encoding (what serving produces) and that do not depend on which clips share a batch.
``--audio-batching report`` (:mod:`.batching`) encodes as the report did: :meth:`MediaEncoders.encode`
with ``padded=True`` (:func:`apertus_plugins.encoders.encode_audio_padded`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["MediaEncoders", "resolve_device"]


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when torch sees a GPU, else ``cpu``; any other device is returned as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class MediaEncoders:
    """Encoders of one checkpoint, loaded on first use of each modality.

    Each modality's encoder is loaded once per instance (``loads`` counts the loads).

    Args:
        checkpoint: a released-layout checkpoint directory (``config.json`` + safetensors).
        device: ``"auto"`` (see :func:`resolve_device`), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        precision: ``"float32"`` or ``"tf32"`` (CUDA only): the encoders' precision contract.
        batch_size: most items per forward pass.
        cache: a :class:`~apertus_plugins.encoders.cache.MediaCodeCache` for image and audio codes
            (a plugin modality's encoder is always run).
    """

    def __init__(self, checkpoint: str | None, device: str = "cpu", precision: str = "float32",
                 batch_size: int = 32, cache: Any = None) -> None:
        self.checkpoint = checkpoint
        self.cache = cache
        self.device = resolve_device(device)
        self.precision = precision
        self.batch_size = batch_size
        self._models: dict[str, Any] = {}
        self.loads = 0

    def load(self, modality: str) -> None:
        """Load a modality's encoder now (the first :meth:`encode` of it would)."""
        self._model(modality)

    def _model(self, modality: str) -> Any:
        if modality in self._models:
            return self._models[modality]
        if self.checkpoint is None:
            raise ValueError(f"{modality} items need the media encoders: pass --checkpoint DIR")
        _set_threads()
        from apertus_plugins import encoders

        loaders = {"image": encoders.load_vision_tokenizer, "audio": encoders.load_audio_tokenizer}
        if modality in loaders:
            model = loaders[modality](self.checkpoint, device=self.device, precision=self.precision)
        else:
            from .sources import plugin_modality

            factory = plugin_modality(modality, "tokenizer_factory").tokenizer_factory
            model = factory(self.checkpoint, device=self.device, precision=self.precision)
        self._models[modality] = model
        self.loads += 1
        return model

    def encode(self, modality: str, arrays: list[np.ndarray], padded: bool = False) -> list[np.ndarray]:
        """Codes of preprocessed items (image pixels ``[3, H, W]``, audio ``[samples]``, a plugin
        modality's arrays), in input order.

        ``padded`` (audio only): ``arrays`` are ONE batch padded to the longest, the last five codes
        of a padded clip dropped (the report's batching; the media-code cache is not used).
        """
        if not arrays:
            return []
        from apertus_plugins import encoders

        model = self._model(modality)
        if padded:
            if modality != "audio":
                raise ValueError(f"padded batches are for audio only, not {modality}")
            codes = encoders.encode_audio_padded(model, arrays)
        elif modality == "image":
            codes = encoders.encode_images(model, arrays, batch_size=self.batch_size, cache=self.cache)
        elif modality == "audio":
            codes = encoders.encode_audio(model, arrays, batch_size=self.batch_size, cache=self.cache)
        else:  # a plugin modality's encoder (Modality.tokenizer_factory)
            codes = model.encode(arrays, batch_size=self.batch_size)
        return [np.asarray(c, dtype=np.int64) for c in codes]


def _set_threads() -> None:
    """Intra-op threads of this worker process (``APERTUS_TOKENIZE_THREADS``, set by the driver)."""
    n = os.environ.get("APERTUS_TOKENIZE_THREADS")
    if n:
        import torch

        torch.set_num_threads(max(1, int(n)))
