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
from .errors import ImageError
from .limits import MediaLimits, check_image_size, prereduce_factor

__all__ = [
    "PATCH", "MIN_PIXELS", "MAX_PIXELS", "MAX_ASPECT", "POLICIES", "KERNELS", "LAYOUTS", "ResizePolicy",
    "PreprocessedImage", "ImageError", "ImageLayoutError", "normalize_pixels", "register_policy", "to_rgb_array",
    "open_image", "decode_image",
    "resized_size", "image_grid", "preprocess_image", "image_sequence", "image_placeholder_sequence",
    "image_layouts_in", "detect_image_layout", "text_ids_from_tokenizer", "byte_text_ids",
]

PATCH = 16
MIN_PIXELS = 128 * 128
MAX_PIXELS = 1400 * 1400
MAX_ASPECT = 200


class ImageLayoutError(ValueError):
    """A token sequence whose images are malformed or mix the two layouts (train/serve skew)."""


@dataclass(frozen=True)
class ResizePolicy:
    """How an image is sized and resampled: the pixel budget, the patch multiple, the rule, the kernel.

    ``rule`` is ``"smart"`` (the released processor's ``smart_resize``) or ``"area"`` (the Emu3.5
    reference variant: scale to ``max_pixels`` whatever the input size). ``kernel`` names an entry of
    :data:`KERNELS`.
    """

    name: str
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    factor: int = PATCH
    rule: str = "smart"
    kernel: str = "torch-aa-bicubic"


#: Resize policies by name. ``released`` reproduces ``Apertus1p5ImageProcessor`` exactly; ``pil``
#: keeps its sizes but resamples with Pillow's bicubic; ``area`` is the Emu3.5 reference rule.
POLICIES: dict[str, ResizePolicy] = {
    "released": ResizePolicy("released"),
    "pil": ResizePolicy("pil", kernel="pil-bicubic"),
    "area": ResizePolicy("area", rule="area", kernel="pil-bicubic"),
}

_RULES = ("smart", "area")


def register_policy(policy: ResizePolicy, replace: bool = False) -> ResizePolicy:
    """Add a policy to :data:`POLICIES`; an existing name needs ``replace=True``."""
    if policy.rule not in _RULES:
        raise ValueError(f"policy {policy.name!r}: unknown size rule {policy.rule!r}; rules are {', '.join(_RULES)}")
    if policy.kernel not in KERNELS:
        raise ValueError(f"policy {policy.name!r}: unknown kernel {policy.kernel!r}; kernels are {', '.join(KERNELS)}")
    if policy.name in POLICIES and not replace:
        raise ValueError(f"resize policy {policy.name!r} is already registered")
    POLICIES[policy.name] = policy
    return policy


def _policy(policy: str | ResizePolicy) -> ResizePolicy:
    if isinstance(policy, ResizePolicy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown resize policy {policy!r}; policies are {', '.join(POLICIES)}") from None


def resized_size(height: int, width: int, policy: str | ResizePolicy = "released") -> tuple[int, int]:
    """The post-resize ``(height, width)``: multiples of 16, aspect ratio kept, from the original size alone.

    ``smart`` (released): round each side to the nearest multiple (Python ``round``, ties to even);
    if the product is above ``max_pixels`` divide both sides by sqrt(H*W/max) and floor to multiples
    (at least one multiple); if below ``min_pixels`` multiply by sqrt(min/(H*W)) and ceil.
    ``area`` (Emu3.5 reference): multiply both sides by sqrt(max_pixels/(H*W)), up or down, and
    round to the nearest multiple (at least one). An aspect ratio above 200 raises
    :class:`ImageError` naming the size.
    """
    p = _policy(policy)
    height, width = int(height), int(width)
    if height <= 0 or width <= 0:
        raise ImageError(f"image of size {height}x{width} has no pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"image of size {height}x{width}: aspect ratio {max(height, width) / min(height, width):.1f} "
                         f"is above {MAX_ASPECT}")
    f = p.factor
    if p.rule == "area":
        scale = math.sqrt(p.max_pixels / (height * width))
        return max(f, round(height * scale / f) * f), max(f, round(width * scale / f) * f)
    h_bar = round(height / f) * f
    w_bar = round(width / f) * f
    if h_bar * w_bar > p.max_pixels:
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


def _pil_bicubic(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Pillow's own bicubic (``Image.resize(BICUBIC)``, 22-bit fixed point, one pass per axis)."""
    from PIL import Image

    h, w = size
    if rgb.shape[:2] == (h, w):
        return rgb
    return np.asarray(Image.fromarray(rgb, "RGB").resize((w, h), Image.Resampling.BICUBIC), dtype=np.uint8)


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
    total = np.zeros((out_size, 1), dtype=np.float64)
    for j in range(w.shape[1]):  # left to right, as the C++ loop accumulates (numpy's sum is pairwise)
        total = total + w[:, j : j + 1]
    w = np.where(total != 0.0, w / np.where(total == 0.0, 1.0, total), 0.0)
    max_w = float(w.max())
    prec = 0
    while prec < 22 and int(0.5 + max_w * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    scaled = w * (1 << prec)
    wi = np.where(w < 0, np.trunc(-0.5 + scaled), np.trunc(0.5 + scaled)).astype(np.int64)
    return xmin, wi, prec


#: Float64 elements of one chunk of the exact resize (32 MiB): the resize never converts a whole
#: image, whatever its size; chunks are whole rows (or columns), so the result does not depend on them.
_CHUNK_ELEMENTS = 1 << 22
#: Outputs per block of the banded weight matrix: each block is a small dense matrix product.
_BLOCK = 8


def _aa_blocks(in_size: int, out_size: int) -> tuple[list[tuple[int, int, int, int, np.ndarray]], int]:
    """torch's fixed-point weights as dense ``[outputs, inputs]`` blocks of the banded resize matrix."""
    xmin, w, prec = _aa_bicubic_weights(in_size, out_size)
    taps = w.shape[1]
    blocks = []
    for o0 in range(0, out_size, _BLOCK):
        o1 = min(o0 + _BLOCK, out_size)
        lo = int(xmin[o0])
        hi = int(min(in_size, int((xmin[o0:o1] + taps).max())))
        m = np.zeros((o1 - o0, hi - lo), dtype=np.float64)
        rows = np.repeat(np.arange(o1 - o0), taps)
        cols = (xmin[o0:o1, None] + np.arange(taps)[None, :]).ravel() - lo
        vals = w[o0:o1].ravel()
        keep = (cols < hi - lo) & (vals != 0)  # taps past the end carry zero weight
        np.add.at(m, (rows[keep], cols[keep]), vals[keep])
        blocks.append((o0, o1, lo, hi, m))
    return blocks, prec


def _aa_pass(arr: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One separable pass of torch's uint8 antialiased bicubic along ``axis`` (0: rows, 1: columns) of a
    uint8 ``[H, W, C]`` array, bit for bit.

    torch accumulates ``sum(pixel * weight) + 2**(prec-1)`` in int32 and shifts right by ``prec``.
    Every product and partial sum is an integer below 2**31, so float64 (exact to 2**53) gives the
    same integers in any summation order: the pass is a banded matrix product in float64, block by
    block, over chunks of at most :data:`_CHUNK_ELEMENTS` elements (whole rows or columns), each
    read in memory order.
    """
    in_size = arr.shape[axis]
    if in_size == out_size:
        return arr
    blocks, prec = _aa_blocks(in_size, out_size)
    half = float(1 << (prec - 1))
    h, w, c = arr.shape
    if axis == 0:  # [H, W*C]: output rows are combinations of input rows; chunks of columns
        flat = arr.reshape(h, w * c)
        out = np.empty((out_size, w * c), dtype=np.uint8)
        step = max(1, _CHUNK_ELEMENTS // in_size)
        for c0 in range(0, w * c, step):
            piece = flat[:, c0:c0 + step].astype(np.float64)
            acc = np.empty((out_size, piece.shape[1]), dtype=np.float64)
            for o0, o1, lo, hi, m in blocks:
                np.matmul(m, piece[lo:hi], out=acc[o0:o1])
            out[:, c0:c0 + step] = _rounded(acc, half, prec)
        return out.reshape(out_size, w, c)
    # axis 1: [rows*C, W] @ weights.T, a chunk of whole rows at a time
    out = np.empty((h, out_size, c), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // (in_size * c))
    for r0 in range(0, h, step):
        rows = arr[r0:r0 + step]
        piece = np.empty((rows.shape[0], c, w), dtype=np.float64)
        piece[...] = rows.transpose(0, 2, 1)
        piece = piece.reshape(-1, w)
        acc = np.empty((piece.shape[0], out_size), dtype=np.float64)
        for o0, o1, lo, hi, m in blocks:
            acc[:, o0:o1] = piece[:, lo:hi] @ m.T
        out[r0:r0 + step] = _rounded(acc, half, prec).reshape(rows.shape[0], c, out_size).transpose(0, 2, 1)
    return out


def _rounded(acc: np.ndarray, half: float, prec: int) -> np.ndarray:
    """torch's rounding of the fixed-point sums: ``(sum + 2**(prec-1)) >> prec``, clamped to uint8."""
    acc += half
    res = acc.astype(np.int64) >> prec
    np.clip(res, 0, 255, out=res)
    return res.astype(np.uint8)


def _torch_aa_bicubic(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """torch's uint8 antialiased bicubic (what torchvision's resize runs on CPU), in numpy.

    Fixed point as torch does it: per dimension, weights from the a = -0.5 cubic filter widened by
    the scale when downsampling, normalized, scaled to int16 with the largest precision that fits;
    a horizontal then a vertical pass, each rounding to uint8.
    """
    arr = np.asarray(rgb, dtype=np.uint8)
    h, w = size
    return _aa_pass(_aa_pass(arr, w, axis=1), h, axis=0)


#: Resampling kernels by name: ``kernel(uint8 [H, W, 3], (h, w)) -> uint8 [h, w, 3]``.
KERNELS: dict[str, Callable[[np.ndarray, tuple[int, int]], np.ndarray]] = {
    "torch-aa-bicubic": _torch_aa_bicubic,
    "pil-bicubic": _pil_bicubic,
}


#: Modes ``Image.reduce`` works in; others are converted first (a palette with transparency to RGBA).
_REDUCIBLE = ("L", "LA", "RGB", "RGBA", "I", "F")


def _name(source: Any) -> str:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(source)} bytes>"
    return str(source)


def open_image(source: Any, limits: MediaLimits | None = None) -> Any:
    """Open a path or the bytes of an image file lazily: the header is read and checked, no pixel is decoded.

    Returns a PIL image whose size is the header's (decode it with :func:`decode_image`). Raises
    ``FileNotFoundError`` for a missing path and :class:`ImageError` naming the source for
    anything that is not a readable image or is above ``limits.max_image_pixels`` (Pillow's own
    decompression-bomb refusal included).
    """
    import io

    from PIL import Image

    name = _name(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        fh: Any = io.BytesIO(bytes(source))
    else:
        fh = Path(source)
        if not fh.is_file():
            raise FileNotFoundError(f"{fh}: no such image file")
    try:
        img = Image.open(fh)
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{name}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - whatever a decoder raises on a malformed header is bad input
        raise ImageError(f"{name}: not a readable image ({type(exc).__name__}: {exc})") from exc
    try:
        check_image_size(img.height, img.width, limits, name)
    except ImageError:
        img.close()
        raise
    return img


def decode_image(img: Any, draft: tuple[int, int] | None = None, name: str = "image") -> Any:
    """Decode a lazily opened image, EXIF-transposed; ``draft=(width, height)`` lets a JPEG decoder
    scale down while decoding (to no less than that size). Decoding errors are :class:`ImageError`."""
    return _decode(img, draft, name)[0]


def _decode(img: Any, draft: tuple[int, int] | None, name: str) -> tuple[Any, bool]:
    """(decoded image, whether the EXIF orientation swapped its sides)."""
    from PIL import ImageOps

    try:
        if draft is not None and getattr(img, "format", None) == "JPEG":
            img.draft("RGB", draft)
        img.load()
        stored = img.size
        ImageOps.exif_transpose(img, in_place=True)  # no copy of an image that needs no turn
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data, broken EXIF: the item is bad input
        raise ImageError(f"{name}: not a readable image ({type(exc).__name__}: {exc})") from exc
    return img, img.size != stored


def _open(source: Any, limits: MediaLimits | None = None) -> Any:
    """Open, check and decode a path or the bytes of an image file, EXIF-transposed."""
    return decode_image(open_image(source, limits), name=_name(source))


def _array_to_rgb(arr: np.ndarray) -> np.ndarray:
    """A uint8 array as the released processor's tensor path converts it (channels first or last)."""
    if arr.dtype != np.uint8:
        raise ImageError(f"image arrays must be uint8, got {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    elif arr.ndim != 3:
        raise ImageError(f"image arrays must be [H, W], [H, W, C] or [C, H, W], got shape {list(arr.shape)}")
    elif arr.shape[0] in (1, 3, 4):  # transformers' inference: a leading 1/3/4 is the channel axis
        arr = np.moveaxis(arr, 0, -1)
    elif arr.shape[-1] not in (1, 3, 4):
        raise ImageError(f"cannot find the channel axis of an image array of shape {list(arr.shape)}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ImageError(f"image array of shape {list(arr.shape)} has no pixels")
    c = arr.shape[-1]
    if c == 1:
        return np.repeat(arr, 3, axis=-1)
    if c == 3:
        return np.ascontiguousarray(arr)
    # RGBA: torchvision's float32 composite onto white, then its float -> uint8 conversion
    x = arr.astype(np.float32) * np.float32(1.0 / 255)
    alpha = x[..., 3:]
    comp = x[..., :3] * alpha + (np.float32(1.0) - alpha)
    return (comp * np.float32(255 + 1.0 - 1e-3)).astype(np.uint8)


def _pil_to_rgb(image: Any) -> np.ndarray:
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def to_rgb_array(image: Any, limits: MediaLimits | None = None) -> np.ndarray:
    """An image as uint8 ``[H, W, 3]`` RGB, converted as the released processor converts it.

    PIL images with an alpha band or a ``transparency`` entry are composited onto white
    (``Image.alpha_composite``), others go through ``convert("RGB")``; paths and the bytes of an
    image file are opened with Pillow (their header checked against ``limits`` first) and
    EXIF-transposed; uint8 arrays (``[H, W]``, ``[H, W, C]`` or ``[C, H, W]`` with
    C in 1, 3, 4) follow the processor's tensor path (grey repeated, RGBA composited onto white
    in float32).
    """
    from PIL import Image

    if isinstance(image, np.ndarray):
        rgb = _array_to_rgb(image)
        check_image_size(rgb.shape[0], rgb.shape[1], limits, "image array")
        return rgb
    if isinstance(image, (str, Path, bytes, bytearray, memoryview)) or hasattr(image, "__fspath__"):
        image = _open(image, limits)
    if not isinstance(image, Image.Image):
        raise ImageError(f"expected a PIL image, a uint8 array or a path, got {type(image).__name__}")
    check_image_size(image.height, image.width, limits)
    return _pil_to_rgb(image)


def _reduce(img: Any, target: tuple[int, int], original: tuple[int, int], limits: MediaLimits | None) -> Any:
    """``img`` (a PIL image of the displayed orientation) reduced by :func:`limits.prereduce_factor`."""
    h, w = original
    if prereduce_factor(h, w, target, limits) == 1:
        return img
    k = max(1, min(img.height // (2 * target[0]), img.width // (2 * target[1])))
    if k == 1:
        return img
    if img.mode not in _REDUCIBLE:
        has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
        img = img.convert("RGBA" if has_alpha else "RGB")
    return img.reduce(k)


def preprocess_image(image: Any, policy: str | ResizePolicy = "released",
                     limits: MediaLimits | None = None) -> PreprocessedImage:
    """Convert to RGB, resize per ``policy`` and map to [-1, 1], within ``limits``.

    Args:
        image: a PIL image, a uint8 array, a path or the bytes of a file (see :func:`to_rgb_array`).
        policy: a name in :data:`POLICIES` or a :class:`ResizePolicy`. ``"released"`` gives the
            released ``Apertus1p5ImageProcessor``'s ``pixel_values`` bit for bit for every image of
            at most ``limits.reduce_above_pixels`` pixels.
        limits: a :class:`~apertus_plugins.core.media.limits.MediaLimits` (default: its defaults). A
            file's size is checked from its header before decoding; an image above
            ``reduce_above_pixels`` is reduced cheaply first (a JPEG decodes in draft mode, then
            ``Image.reduce``), to at least twice the resized size per side; the resized size and
            the grid always come from the original size.

    Returns:
        :class:`PreprocessedImage`: float32 ``[3, H, W]`` pixels, the resized size and the grid.
        The mapping is the processor's fused float32 arithmetic ``(pixel - 127.5) / 127.5`` (its
        rescale by 1/255 and normalization with mean 0.5, std 0.5 folded into one op).

    Raises:
        ImageError: unreadable or truncated file, unsupported array, an aspect ratio above 200,
            or an image above ``limits.max_image_pixels``; the message names the image.
    """
    from PIL import Image

    p = _policy(policy)
    if isinstance(image, (str, Path, bytes, bytearray, memoryview)) or hasattr(image, "__fspath__"):
        name = _name(image)
        lazy = open_image(image, limits)
        sh, sw = lazy.height, lazy.width  # stored orientation; the resize rule is symmetric in the two sides
        th, tw = resized_size(sh, sw, p)
        draft = (2 * tw, 2 * th) if prereduce_factor(sh, sw, (th, tw), limits) > 1 else None
        image, swapped = _decode(lazy, draft, name)
        original = (sw, sh) if swapped else (sh, sw)
    elif isinstance(image, np.ndarray):
        rgb = _array_to_rgb(image)
        original = (rgb.shape[0], rgb.shape[1])
        check_image_size(*original, limits, "image array")
        image = Image.fromarray(rgb, "RGB") if prereduce_factor(*original, resized_size(*original, p), limits) > 1 \
            else rgb
    elif isinstance(image, Image.Image):
        original = (image.height, image.width)
        check_image_size(*original, limits)
    else:
        raise ImageError(f"expected a PIL image, a uint8 array or a path, got {type(image).__name__}")
    h, w = resized_size(original[0], original[1], p)
    if not isinstance(image, np.ndarray):
        image = _pil_to_rgb(_reduce(image, (h, w), original, limits))
    arr = KERNELS[p.kernel](image, (h, w))
    pixels = normalize_pixels(arr).transpose(2, 0, 1)
    return PreprocessedImage(np.ascontiguousarray(pixels), h, w, (h // p.factor, w // p.factor))


def normalize_pixels(arr: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [-1, 1], as ``(x - 127.5) / 127.5`` in float32."""
    half = np.float32(127.5)
    return (arr.astype(np.float32) - half) / half


# ---------------------------------------------------------------------- header text
TextIds = Callable[[str], Sequence[int]]


def text_ids_from_tokenizer(path: str | Path) -> TextIds:
    """A ``text_ids`` callable from a tokenizer directory (or its ``tokenizer.json``).

    Each character is encoded on its own, without special tokens, and must give exactly one id:
    the size header ``"H*W"`` is one token per character.
    """
    from tokenizers import Tokenizer

    p = Path(path)
    tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
    cache: dict[str, int] = {}

    def text_ids(text: str) -> list[int]:
        out = []
        for ch in text:
            if ch not in cache:
                ids = tok.encode(ch, add_special_tokens=False).ids
                if len(ids) != 1:
                    raise ValueError(f"{p}: {ch!r} encodes to {len(ids)} ids {ids}; the image header needs one per character")
                cache[ch] = ids[0]
            out.append(cache[ch])
        return out

    return text_ids


def byte_text_ids(offset: int = 0) -> TextIds:
    """The documented fallback ``text_ids``: ASCII character ``c`` -> ``offset + ord(c)``.

    That is a byte-level vocabulary whose 256 byte tokens start at ``offset``. It is for synthetic
    data and tests; real data must use the tokenizer (:func:`text_ids_from_tokenizer`, or
    ``ChatTokenizer.char_ids``), whose digit ids differ per tokenizer.
    """

    def text_ids(text: str) -> list[int]:
        if not text.isascii():
            raise ValueError(f"byte_text_ids handles ASCII only, got {text!r}")
        return [offset + ord(c) for c in text]

    return text_ids


# ---------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class ImageLayout:
    """How the code rows of an image are delimited between ``<|img_token_start|>`` and ``<|img_end|>``.

    ``trailing_separator``: every row is followed by ``<|img_end_of_row|>`` (else the rows are
    joined: rows - 1 separators). ``end_of_frame``: ``<|img_end_of_frame|>`` follows the grid.
    """

    name: str
    trailing_separator: bool
    end_of_frame: bool

    def num_ids(self, rows: int, cols: int, header_len: int) -> int:
        """Length of an image sequence with this layout (``header_len`` ids of ``"H*W"`` text)."""
        seps = rows if self.trailing_separator else rows - 1
        return 3 + header_len + rows * cols + seps + int(self.end_of_frame)


#: Image sequence layouts by name (SPEC.md 2.1): ``inference`` is the released processor's and
#: the serving default, ``training`` the public Megatron tokenization pipeline's.
LAYOUTS: dict[str, ImageLayout] = {
    "inference": ImageLayout("inference", trailing_separator=False, end_of_frame=False),
    "training": ImageLayout("training", trailing_separator=True, end_of_frame=True),
}


def _layout(layout: str | ImageLayout) -> ImageLayout:
    if isinstance(layout, ImageLayout):
        return layout
    try:
        return LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"unknown image layout {layout!r}; layouts are {', '.join(LAYOUTS)}") from None


def _build(grid: np.ndarray, spec: VocabSpec, layout: str | ImageLayout, text_ids: TextIds | None) -> np.ndarray:
    lay = _layout(layout)
    rows, cols = grid.shape
    if text_ids is None:
        raise ValueError("the image header 'H*W' needs text_ids: text_ids_from_tokenizer(dir), "
                         "ChatTokenizer.char_ids, or byte_text_ids() for synthetic data")
    header = np.asarray(list(text_ids(f"{rows}*{cols}")), dtype=np.int64)
    width = cols + 1
    body = np.full((rows, width), spec.id("img_end_of_row"), dtype=np.int64)
    body[:, :cols] = grid
    flat = body.ravel() if lay.trailing_separator else body.ravel()[:-1]
    tail = [spec.id("img_end_of_frame"), spec.id("img_end")] if lay.end_of_frame else [spec.id("img_end")]
    return np.concatenate([[spec.id("img_start")], header, [spec.id("img_token_start")], flat, tail]).astype(np.int64)


def image_sequence(codes: Any, spec: VocabSpec, layout: str | ImageLayout = "inference",
                   text_ids: TextIds | None = None) -> np.ndarray:
    """Ids of one image from its ``[rows, cols]`` grid of codebook indices.

    ``<|img_start|>`` + ``text_ids("rows*cols")`` + ``<|img_token_start|>`` + the code rows
    + ``<|img_end|>``; ``inference`` joins the rows with ``<|img_end_of_row|>`` (rows - 1
    separators), ``training`` follows every row with it (rows separators) and adds
    ``<|img_end_of_frame|>`` before ``<|img_end|>``. Code ``i`` is id ``image offset + i``.
    """
    grid = np.asarray(codes)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"image codes must be a non-empty [rows, cols] grid, got shape {grid.shape}")
    return _build(spec.code_to_id("image", grid), spec, layout, text_ids)


def image_placeholder_sequence(rows: int, cols: int, spec: VocabSpec, layout: str | ImageLayout = "inference",
                               text_ids: TextIds | None = None) -> np.ndarray:
    """The structure of :func:`image_sequence` with the ``<|image|>`` placeholder at every code position.

    In the inference layout this is what the released processor's ``replace_image_token`` emits
    before codes exist.
    """
    if rows <= 0 or cols <= 0:
        raise ValueError(f"an image grid needs at least one row and column, got {rows}x{cols}")
    return _build(np.full((int(rows), int(cols)), spec.id("image"), dtype=np.int64), spec, layout, text_ids)


def image_layouts_in(ids: Any, spec: VocabSpec) -> list[str]:
    """The layout of every image in ``ids``, in order of appearance.

    Each image is read from ``<|img_start|>`` to the next ``<|img_end|>``: one
    ``<|img_token_start|>``, then rows of equal non-zero length separated by
    ``<|img_end_of_row|>``. A trailing separator with ``<|img_end_of_frame|>`` is ``training``;
    neither is ``inference``; one without the other, ragged rows, nested or unclosed images raise
    :class:`ImageLayoutError` naming the position.
    """
    arr = np.asarray(ids, dtype=np.int64).ravel()
    start, end = spec.id("img_start"), spec.id("img_end")
    tok, eol, eof = spec.id("img_token_start"), spec.id("img_end_of_row"), spec.id("img_end_of_frame")
    starts, ends = np.flatnonzero(arr == start), np.flatnonzero(arr == end)
    if starts.size != ends.size or np.any(starts[1:] < ends[:-1]) or np.any(ends < starts):
        raise ImageLayoutError(f"unbalanced image markers: {starts.size} <|img_start|> at {starts.tolist()[:8]}, "
                               f"{ends.size} <|img_end|> at {ends.tolist()[:8]}")
    found = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        seg = arr[s + 1 : e]
        marks = np.flatnonzero(seg == tok)
        if marks.size != 1:
            raise ImageLayoutError(f"image at position {s}: {marks.size} <|img_token_start|>, expected one")
        body = seg[marks[0] + 1 :]
        framed = body.size > 0 and body[-1] == eof
        if framed:
            body = body[:-1]
        trailing = body.size > 0 and body[-1] == eol
        if np.any(body == eof):
            raise ImageLayoutError(f"image at position {s}: <|img_end_of_frame|> inside the grid")
        if trailing != framed:
            raise ImageLayoutError(
                f"image at position {s} fits neither layout: "
                f"{'a' if trailing else 'no'} trailing <|img_end_of_row|> {'with' if framed else 'without'} "
                "<|img_end_of_frame|>")
        if trailing:
            body = body[:-1]
        seps = np.flatnonzero(body == eol)
        lengths = np.diff(np.concatenate([[-1], seps, [body.size]])) - 1
        if body.size == 0 or lengths.min() <= 0 or np.unique(lengths).size != 1:
            raise ImageLayoutError(f"image at position {s}: ragged or empty rows (lengths {sorted(set(lengths.tolist()))})")
        found.append("training" if framed else "inference")
    return found


def detect_image_layout(ids: Any, spec: VocabSpec, allow_mixed: bool = False) -> str | None:
    """Which layout the images in ``ids`` use: ``"inference"``, ``"training"`` or ``None`` (no image).

    A sequence mixing both layouts raises :class:`ImageLayoutError` (train/serve skew), or returns
    ``"mixed"`` when ``allow_mixed``. Malformed images raise as in :func:`image_layouts_in`.
    """
    names = image_layouts_in(ids, spec)
    kinds = set(names)
    if len(kinds) > 1:
        if allow_mixed:
            return "mixed"
        where = ", ".join(f"image {i}: {n}" for i, n in enumerate(names))
        raise ImageLayoutError(f"the sequence mixes image layouts ({where})")
    return kinds.pop() if kinds else None


def dataset_image_layouts(dataset: Any, spec: VocabSpec, limit: int | None = 64) -> set[str]:
    """The image layouts of the first ``limit`` documents holding an image (all of them with ``None``).

    ``dataset`` has ``num_documents`` and ``document(i)`` (an :class:`apertus_plugins.data.indexed.IndexedDataset`).
    Each such document adds its layout (:func:`detect_image_layout`), ``"mixed"`` for one that mixes
    both; an empty set means no image was found.
    """
    start = spec.id("img_start")
    found: set[str] = set()
    seen = 0
    for d in range(dataset.num_documents):
        ids = dataset.document(d)
        if not np.any(ids == start):
            continue
        layout = detect_image_layout(ids, spec, allow_mixed=True)
        if layout:
            found.add(layout)
        seen += 1
        if limit is not None and seen >= limit:
            break
    return found
