"""Plain reference implementations the core's optimized code is checked and measured against."""

from __future__ import annotations

import numpy as np

from apertus_plugins.core.media import image

__all__ = ["tap_loop_resize"]


def tap_loop_resize(arr: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """``arr`` (uint8) resized along ``axis`` by the straightforward int32 tap loop of torch's fixed-point
    antialiased bicubic: an int32 copy of the whole array and one gather per filter tap (what the
    core's chunked resize did before, and must equal byte for byte)."""
    in_size = arr.shape[axis]
    if in_size == out_size:
        return arr
    xmin, w, prec = image._aa_bicubic_weights(in_size, out_size)
    src = np.moveaxis(arr, axis, 0).astype(np.int32)
    acc = np.full((out_size,) + src.shape[1:], 1 << (prec - 1), dtype=np.int32)
    shape = (out_size,) + (1,) * (src.ndim - 1)
    for j in range(w.shape[1]):
        acc += src[np.minimum(xmin + j, in_size - 1)] * w[:, j].astype(np.int32).reshape(shape)
    return np.moveaxis(np.clip(acc >> prec, 0, 255).astype(np.uint8), 0, axis)
