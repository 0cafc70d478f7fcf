"""An example ``video`` modality for Apertus 1.5, registered through the ``apertus`` hooks.

A video is a ``.npy`` file of uint8 frames ``[T, H, W, 3]`` (H and W multiples of 16). Its
sequence is ``<|video_start|>``, each frame as an image in the requested image layout (the image
codebook: the frames are encoded by the checkpoint's vision tokenizer), then ``<|video_end|>``;
a conversation names it with a ``video_url`` part, which the chat template renders as
``<|video|>``. The three markers take omni slots 16 to 18, free in the released layout.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from apertus_plugins.plugins.hooks import Modality, hookimpl

PATCH = 16


def _frames(data: bytes) -> np.ndarray:
    arr = np.load(io.BytesIO(data), allow_pickle=False)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3 or 0 in arr.shape:
        raise ValueError(f"a video is uint8 frames [T, H, W, 3], got {arr.dtype} {list(arr.shape)}")
    if arr.shape[1] % PATCH or arr.shape[2] % PATCH:
        raise ValueError(f"frame size {arr.shape[1]}x{arr.shape[2]} is not a multiple of {PATCH}")
    return arr


def probe(data: bytes) -> tuple[list[int], int]:
    """``[T, H, W]`` after the released resize, and the number of codes of all frames."""
    from apertus_plugins.core.media.image import image_grid, resized_size

    t, h, w, _ = _frames(data).shape
    rows, cols = image_grid(h, w, "released")
    return [t, *resized_size(h, w, "released")], t * rows * cols


def load(data: bytes) -> np.ndarray:
    """Pixels ``[T, 3, H, W]`` in [-1, 1], each frame preprocessed as the core preprocesses images."""
    from apertus_plugins.core.media.image import preprocess_image

    return np.stack([preprocess_image(frame, "released").pixels for frame in _frames(data)])


class FrameEncoder:
    """Codes ``[T, rows, cols]`` of a video: its frames through the checkpoint's vision tokenizer."""

    def __init__(self, checkpoint: str, device: str = "cpu", precision: str = "float32") -> None:
        from apertus_plugins.encoders import load_vision_tokenizer

        self.model = load_vision_tokenizer(checkpoint, device=device, precision=precision)

    def encode(self, arrays: list[np.ndarray], batch_size: int = 32) -> list[np.ndarray]:
        from apertus_plugins.encoders import encode_images

        return [np.stack([np.asarray(c) for c in encode_images(self.model, list(v), batch_size=batch_size)])
                for v in arrays]


def build_sequence(codes: Any, spec: Any, text_ids: Any = None, layout: str = "inference") -> np.ndarray:
    """``<|video_start|>``, each frame's image sequence in the image ``layout``, ``<|video_end|>``."""
    from apertus_plugins.core.media.image import image_sequence

    frames = [image_sequence(c, spec, layout, text_ids=text_ids) for c in np.asarray(codes)]
    return np.concatenate([[spec.id("video_start")], *frames, [spec.id("video_end")]]).astype(np.int64)


VIDEO = Modality(
    name="video",
    placeholder="video",
    part_types=("video_url",),
    layouts=("inference", "training"),
    build_sequence=build_sequence,
    tokenizer_factory=FrameEncoder,
    slots={16: ("video", "<|video|>"), 17: ("video_start", "<|video_start|>"), 18: ("video_end", "<|video_end|>")},
    code_block="image",
    probe=probe,
    load=load,
)


@hookimpl
def apertus_modalities() -> list[Modality]:
    return [VIDEO]
