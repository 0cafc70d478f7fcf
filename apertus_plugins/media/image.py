"""Images as token sequences (SPEC.md 2.1): resize policies, grid sizes and the two layouts.

The vision tokenizer emits one code per 16x16 block, so an image resized to H x W pixels is an
(H/16) x (W/16) grid. :func:`resized_size` and :func:`image_grid` need only the original size
(planning works from headers, without decoding pixels). The sequence layouts are registered by
name in :data:`LAYOUTS`: ``inference`` (the released processor and serving) and ``training``
(the public Megatron tokenization pipeline).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..vocab import VocabSpec

__all__ = [
    "PATCH", "MIN_PIXELS", "MAX_PIXELS", "MAX_ASPECT", "POLICIES", "KERNELS", "LAYOUTS", "ResizePolicy",
    "PreprocessedImage", "normalize_pixels", "resized_size", "image_grid", "preprocess_image", "image_sequence",
    "image_placeholder_sequence", "detect_image_layout",
]

PATCH = 16
MIN_PIXELS = 128 * 128
MAX_PIXELS = 1400 * 1400
MAX_ASPECT = 200


class ImageError(ValueError):
    """An image that cannot be turned into a token sequence; the message names it."""


@dataclass(frozen=True)
class ResizePolicy:
    """How an image is sized: the pixel budget, the patch multiple, the rounding rule, the kernel."""

    name: str
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    factor: int = PATCH
    rule: str = "smart"  # "smart" (released processor) or "area" (Emu3.5 reference: resize to the budget)
    kernel: str = "torch-aa-bicubic"


POLICIES: dict[str, ResizePolicy] = {
    "released": ResizePolicy("released"),
    "area": ResizePolicy("area", rule="area"),
}


def _policy(policy: str | ResizePolicy) -> ResizePolicy:
    if isinstance(policy, ResizePolicy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown resize policy {policy!r}; policies are {', '.join(POLICIES)}") from None


def resized_size(height: int, width: int, policy: str | ResizePolicy = "released") -> tuple[int, int]:
    """The post-resize (height, width): multiples of 16 within the pixel budget, aspect kept.

    ``smart``: round each side to the nearest multiple; above the budget scale by
    sqrt(H*W/max) and floor to multiples; below it scale up and ceil. ``area``: scale to the
    budget's upper end when above it, else as ``smart``. An aspect ratio above 200 is an error.
    """
    p = _policy(policy)
    if height <= 0 or width <= 0:
        raise ImageError(f"image of size {height}x{width} has no pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"image of size {height}x{width}: aspect ratio {max(height, width) / min(height, width):.1f} "
                         f"is above {MAX_ASPECT}")
    f = p.factor
    h_bar = round(height / f) * f
    w_bar = round(width / f) * f
    if h_bar * w_bar > p.max_pixels or (p.rule == "area" and height * width > p.max_pixels):
        beta = math.sqrt(height * width / p.max_pixels)
        h_bar = max(f, math.floor(height / beta / f) * f)
        w_bar = max(f, math.floor(width / beta / f) * f)
    elif h_bar * w_bar < p.min_pixels:
        beta = math.sqrt(p.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / f) * f
        w_bar = math.ceil(width * beta / f) * f
    return h_bar, w_bar


def image_grid(height: int, width: int, policy: str | ResizePolicy = "released") -> tuple[int, int]:
    """(rows, cols) of the code grid of an image of the given original size."""
    h, w = resized_size(height, width, policy)
    f = _policy(policy).factor
    return h // f, w // f


@dataclass
class PreprocessedImage:
    """Pixels in [-1, 1] (float32, [3, H, W]) with the resized size and the code grid."""

    pixels: np.ndarray
    height: int
    width: int
    grid: tuple[int, int]


def _pil_bicubic(img: Any, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    h, w = size
    return np.asarray(img.resize((w, h), Image.Resampling.BICUBIC), dtype=np.uint8)


def _aa_bicubic_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Start indices, int16-scaled weights [out, K] and precision of torch's uint8 antialiased bicubic."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    centers = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    xmin = np.maximum((centers - support + 0.5).astype(np.int64), 0)
    xmax = np.minimum((centers + support + 0.5).astype(np.int64), in_size)
    size = xmax - xmin
    k = np.arange(int(size.max()), dtype=np.float64)
    x = np.abs((k[None, :] + xmin[:, None] - centers[:, None] + 0.5) * invscale)
    a = -0.5
    w = np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                 np.where(x < 2.0, (((x - 5.0) * x + 8.0) * x - 4.0) * a, 0.0))
    w = np.where(k[None, :] < size[:, None], w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0.0, w / np.where(total == 0.0, 1.0, total), 0.0)
    max_w = float(w.max())
    prec = 0
    while prec < 22 and int(0.5 + max_w * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    scaled = w * (1 << prec)
    wi = np.where(w < 0, np.trunc(-0.5 + scaled), np.trunc(0.5 + scaled)).astype(np.int64)
    return xmin, wi, prec


def _aa_pass(arr: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    in_size = arr.shape[axis]
    if in_size == out_size:
        return arr
    xmin, w, prec = _aa_bicubic_weights(in_size, out_size)
    src = np.moveaxis(arr, axis, 0).astype(np.int64)
    acc = np.full((out_size,) + src.shape[1:], 1 << (prec - 1), dtype=np.int64)
    shape = (out_size,) + (1,) * (src.ndim - 1)
    for j in range(w.shape[1]):
        idx = np.minimum(xmin + j, in_size - 1)
        acc += src[idx] * w[:, j].reshape(shape)
    out = np.clip(acc >> prec, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def _torch_aa_bicubic(img: Any, size: tuple[int, int]) -> np.ndarray:
    """torch's uint8 antialiased bicubic (what torchvision's resize runs on CPU), in numpy.

    Fixed point as torch does it: per dimension, weights from the a = -0.5 cubic filter widened by
    the scale when downsampling, normalized, scaled to int16 with the largest precision that fits;
    a horizontal then a vertical pass, each rounding to uint8.
    """
    arr = np.asarray(img, dtype=np.uint8)
    h, w = size
    return _aa_pass(_aa_pass(arr, w, axis=1), h, axis=0)


#: Resampling kernels by name: ``kernel(pil_rgb_image, (h, w)) -> uint8 [h, w, 3]``.
KERNELS: dict[str, Callable[[Any, tuple[int, int]], np.ndarray]] = {
    "torch-aa-bicubic": _torch_aa_bicubic,
    "pil-bicubic": _pil_bicubic,
}


def _open(image: Any) -> Any:
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray):
        return Image.fromarray(image)
    path = Path(image)
    try:
        img = Image.open(path)
        img.load()
    except FileNotFoundError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ImageError(f"{path}: not a readable image ({exc})") from exc
    return img


def preprocess_image(image: Any, policy: str | ResizePolicy = "released") -> PreprocessedImage:
    """Convert to RGB, resize per ``policy`` and map to [-1, 1].

    The mapping is the released processor's float32 arithmetic, ``(pixel - 127.5) / 127.5``
    (its rescale by 1/255 and normalization by mean 0.5, std 0.5, fused).
    """
    p = _policy(policy)
    img = _open(image).convert("RGB")
    h, w = resized_size(img.height, img.width, p)
    arr = KERNELS[p.kernel](img, (h, w))
    pixels = normalize_pixels(arr).transpose(2, 0, 1)
    return PreprocessedImage(np.ascontiguousarray(pixels), h, w, (h // p.factor, w // p.factor))


def normalize_pixels(arr: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [-1, 1], as ``(x - 127.5) / 127.5`` in float32."""
    half = np.float32(127.5)
    return (arr.astype(np.float32) - half) / half


# ---------------------------------------------------------------------- layouts
def _header(rows: int, cols: int, spec: VocabSpec, text_ids: Callable[[str], Sequence[int]] | None) -> list[int]:
    if text_ids is None:
        raise ValueError("the image header 'H*W' needs text_ids (e.g. ChatTokenizer.char_ids) to tokenize it")
    return [spec.id("img_start"), *text_ids(f"{rows}*{cols}"), spec.id("img_token_start")]


def _rows(grid: np.ndarray, spec: VocabSpec, trailing: bool) -> list[int]:
    sep = spec.id("img_end_of_row")
    out: list[int] = []
    for r, row in enumerate(grid):
        out.extend(int(i) for i in row)
        if trailing or r < len(grid) - 1:
            out.append(sep)
    return out


def _inference(grid: np.ndarray, spec: VocabSpec, header: list[int]) -> list[int]:
    return header + _rows(grid, spec, trailing=False) + [spec.id("img_end")]


def _training(grid: np.ndarray, spec: VocabSpec, header: list[int]) -> list[int]:
    return header + _rows(grid, spec, trailing=True) + [spec.id("img_end_of_frame"), spec.id("img_end")]


#: Image sequence layouts by name.
LAYOUTS: dict[str, Callable[[np.ndarray, VocabSpec, list[int]], list[int]]] = {
    "inference": _inference,
    "training": _training,
}


def _layout(name: str) -> Callable[[np.ndarray, VocabSpec, list[int]], list[int]]:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown image layout {name!r}; layouts are {', '.join(LAYOUTS)}") from None


def image_sequence(codes: Any, spec: VocabSpec, layout: str = "inference",
                   text_ids: Callable[[str], Sequence[int]] | None = None) -> np.ndarray:
    """Ids of one image from its [rows, cols] grid of codebook indices."""
    grid = np.asarray(codes)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"image codes must be a non-empty [rows, cols] grid, got shape {grid.shape}")
    ids = spec.code_to_id("image", grid)
    return np.asarray(_layout(layout)(ids, spec, _header(*grid.shape, spec, text_ids)), dtype=np.int64)


def image_placeholder_sequence(rows: int, cols: int, spec: VocabSpec, layout: str = "inference",
                               text_ids: Callable[[str], Sequence[int]] | None = None) -> np.ndarray:
    """The same structure with the ``<|image|>`` placeholder id at every code position."""
    grid = np.full((rows, cols), spec.id("image"), dtype=np.int64)
    return np.asarray(_layout(layout)(grid, spec, _header(rows, cols, spec, text_ids)), dtype=np.int64)


def detect_image_layout(ids: Any, spec: VocabSpec) -> str | None:
    """Which layout the images in ``ids`` use: ``"inference"``, ``"training"`` or ``None`` (no image).

    An image whose code grid is followed by ``<|img_end_of_frame|>`` is in the training layout.
    A sequence mixing both raises ``ValueError``.
    """
    arr = np.asarray(ids, dtype=np.int64)
    ends = np.flatnonzero(arr == spec.id("img_end"))
    found = set()
    for e in ends:
        found.add("training" if e > 0 and arr[e - 1] == spec.id("img_end_of_frame") else "inference")
    if len(found) > 1:
        raise ValueError(f"the sequence mixes image layouts ({len(ends)} images, both inference and training)")
    return found.pop() if found else None
