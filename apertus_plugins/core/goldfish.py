"""Goldfish loss: drop the targets of a deterministic pseudo-random ~1/k of the label positions (SPEC.md 4.1).

Whether label position ``j`` drops depends only on the ``h`` labels ``labels[j-h+1 .. j]`` that end
there, so the same text drops the same positions whatever the batch, rank, worker or resume point.
The first ``h-1`` positions of a sequence never drop (their window is incomplete) unless the caller
passes the preceding labels as ``context``. Labels in the exempt set (by default the vocabulary's
special ids, which include the whole omni block) never drop; content codes stay eligible.

Two variants, chosen by name:

``"hashtable"`` (bit-compatible with the public implementation)
    ``table`` holds 1,000,003 float32 values of ``torch.rand(1_000_003,
    generator=torch.Generator().manual_seed(2971215073))`` (shipped with the package, so torch is not
    needed). For ``j >= h-1``: ``key = prod(labels[j-h+1 .. j])`` computed in int64 with wrap-around,
    then ``key mod 1,000,003`` with floor semantics (the result has the sign of the divisor, as
    torch's ``%``/``remainder`` and numpy's ``%`` on int64), and the label drops iff
    ``table[key] < float32(1/k)``. Order-insensitive; every window holding a 0 label gets key 0.

``"order-sensitive"``
    Coefficients ``c[0..h-1] = numpy.random.Generator(numpy.random.PCG64(2971215073 + h)).integers(0,
    2**62, size=h, dtype=numpy.int64) | 1`` (odd, below 2**62). For ``j >= h-1``:
    ``key = sum_i c[i] * labels[j-h+1+i]`` computed in int64 with wrap-around, floor-mod 1,000,003,
    and the same table test.

Both are vectorized: the window product uses prefix doubling (``O(L log h)`` multiplications; a
rolling product cannot divide out a leaving label because even labels are not invertible modulo
2**64), the weighted sum a fixed number of whole-array multiply-adds per coefficient, done in
cache-sized chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import numpy as np

from ._arrays import like as _like
from ._arrays import to_numpy as _to_numpy
from .vocab import VocabSpec, default_spec

__all__ = [
    "TABLE_SIZE",
    "TABLE_SEED",
    "VARIANTS",
    "GoldfishConfig",
    "goldfish_table",
    "order_sensitive_coefficients",
    "goldfish_keys",
    "goldfish_drop",
    "exempt_table",
]

TABLE_SIZE = 1_000_003
TABLE_SEED = 2971215073
VARIANTS = ("hashtable", "order-sensitive")
_TABLE_FILE = f"goldfish_table_{TABLE_SEED}.npz"
_CHUNK = 1 << 15


@dataclass(frozen=True)
class GoldfishConfig:
    """Goldfish loss settings, one documented field each (Apertus 1.0's parameters, unchanged in 1.5).

    Built once (from Megatron's ``--apertus-goldfish-*`` flags, a recipe, or by hand) and handed down to
    every place that drops targets: :func:`apertus_plugins.core.targets.pretraining_targets` and
    :func:`apertus_plugins.core.targets.sft_targets`.
    """

    k: int = 50
    """Drop rate about ``1/k`` of the eligible label positions (report: k = 50)."""
    h: int = 50
    """Window: a position's fate is decided by the ``h`` labels that end there (report: h = 50)."""
    variant: str = "hashtable"
    """``"hashtable"`` (bit-compatible with the public implementation) or ``"order-sensitive"``."""
    on_sft: bool = False
    """Also drop SFT targets (the report applies Goldfish in continued pretraining only)."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"Goldfish k must be >= 1 (about 1/k of the positions drop), got {self.k}")
        if self.h < 1:
            raise ValueError(f"Goldfish h must be >= 1, got {self.h}")
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown Goldfish variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")

    @classmethod
    def coerce(cls, value: GoldfishConfig | Mapping[str, Any] | None) -> GoldfishConfig | None:
        """``value`` as a config: a config as is, a mapping of its fields (``k``, ``h``, ``variant``), or None
        (also for a mapping with ``k <= 0``, which drops nothing)."""
        if value is None or isinstance(value, cls):
            return value
        if int(value.get("k", 50)) <= 0:  # goldfish_drop's rule: k <= 0 drops nothing
            return None
        unknown = set(value) - {"k", "h", "variant", "on_sft"}
        if unknown:
            raise ValueError(f"unknown Goldfish settings {sorted(unknown)}; the fields are k, h, variant, on_sft")
        return cls(**dict(value))

    def drop(self, labels: Any, spec: VocabSpec | None = None, *, context: Any = None) -> Any:
        """:func:`goldfish_drop` of ``labels`` with these settings (True = dropped)."""
        return goldfish_drop(labels, k=self.k, h=self.h, variant=self.variant, spec=spec, context=context)

    def describe(self) -> str:
        """``k=50 h=50 hashtable`` (``, SFT too`` when it drops SFT targets)."""
        return f"k={self.k} h={self.h} {self.variant}" + (", SFT too" if self.on_sft else "")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@lru_cache(maxsize=1)
def goldfish_table() -> np.ndarray:
    """The 1,000,003 float32 values of the public table, read from the package data (read-only).

    ``torch.rand`` on a CPU generator yields multiples of 2**-24, so the file stores each value as
    a 24-bit integer (three little-endian bytes) and this function rebuilds the float32 exactly.
    """
    with resources.files("apertus_plugins.assets").joinpath(_TABLE_FILE).open("rb") as fh:
        with np.load(fh) as data:
            packed = np.asarray(data["u24"], dtype=np.uint8)
    if packed.shape != (TABLE_SIZE, 3):
        raise ValueError(f"{_TABLE_FILE}: expected a ({TABLE_SIZE}, 3) uint8 array, found {packed.shape}")
    table = unpack_table(packed)
    table.flags.writeable = False
    return table


def pack_table(table: np.ndarray) -> np.ndarray:
    """Pack float32 multiples of 2**-24 in [0, 1) into an (N, 3) uint8 array (for writing the data file)."""
    t = np.asarray(table, dtype=np.float32)
    scaled = t.astype(np.float64) * float(1 << 24)
    ints = scaled.astype(np.uint32)
    if not np.array_equal(ints.astype(np.float64), scaled) or ints.max(initial=0) >= 1 << 24:
        raise ValueError("table values are not multiples of 2**-24 in [0, 1)")
    return ints.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].copy()


def unpack_table(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_table`: (N, 3) uint8 -> float32 values."""
    p = np.asarray(packed, dtype=np.uint32)
    ints = p[:, 0] | (p[:, 1] << 8) | (p[:, 2] << 16)
    return (ints.astype(np.float64) / float(1 << 24)).astype(np.float32)


@lru_cache(maxsize=64)
def order_sensitive_coefficients(h: int, seed: int = TABLE_SEED) -> np.ndarray:
    """The ``h`` odd int64 coefficients of the order-sensitive variant (see the module docstring)."""
    gen = np.random.Generator(np.random.PCG64(seed + h))
    coeffs = gen.integers(0, 1 << 62, size=h, dtype=np.int64) | np.int64(1)
    coeffs.flags.writeable = False
    return coeffs


def exempt_table(spec: VocabSpec, size: int | None = None) -> np.ndarray:
    """Boolean lookup over ids: True for ids whose label never drops (special ids and the omni block)."""
    table = np.zeros(max(size or 0, spec.size), dtype=bool)
    ids = np.fromiter(spec.special_ids, dtype=np.int64)
    table[ids[ids < table.size]] = True
    table[spec.omni_offset : spec.omni_offset + spec.omni_size] = True
    return table


def _window_product(x: np.ndarray, h: int) -> np.ndarray:
    """``out[s] = prod(x[s : s+h])`` modulo 2**64 (uint64), for ``s`` in ``0 .. len(x)-h``, by doubling."""
    n = x.size - h + 1
    result: np.ndarray | None = None
    covered = 0  # width of the windows `result` holds
    power = x  # power[s] = prod(x[s : s + width])
    width = 1
    while True:
        if h & width:
            if result is None:
                result = power[: x.size - width + 1].copy()
            else:
                m = x.size - covered - width + 1
                np.multiply(result[:m], power[covered : covered + m], out=result[:m])
                result = result[:m]
            covered += width
        if width * 2 > h:
            break
        m = power.size - width
        power = power[:m] * power[width : width + m]
        width *= 2
    assert result is not None and covered == h
    return result[:n]


def _window_weighted_sum(x: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """``out[s] = sum_i coeffs[i] * x[s+i]`` modulo 2**64 (uint64), for ``s`` in ``0 .. len(x)-h``."""
    h = coeffs.size
    n = x.size - h + 1
    c = coeffs.view(np.uint64)
    out = np.empty(n, dtype=np.uint64)
    tmp = np.empty(min(n, _CHUNK), dtype=np.uint64)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        m = stop - start
        acc = out[start:stop]
        np.multiply(x[start:stop], c[0], out=acc)
        t = tmp[:m]
        for i in range(1, h):
            np.multiply(x[start + i : stop + i], c[i], out=t)
            np.add(acc, t, out=acc)
    return out


def goldfish_keys(labels: Any, h: int = 50, variant: str = "hashtable") -> np.ndarray:
    """The table keys (int64 in ``[0, 1,000,003)``) of the complete windows of a 1-D label array.

    ``out[s]`` is the key of the window ``labels[s .. s+h-1]``, i.e. of label position ``s+h-1``;
    the result has ``max(len(labels) - h + 1, 0)`` entries.
    """
    if h < 1:
        raise ValueError(f"goldfish h must be >= 1, got {h}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown goldfish variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    x = np.ascontiguousarray(np.asarray(labels).astype(np.int64, copy=False)).view(np.uint64)
    if x.ndim != 1:
        raise ValueError(f"goldfish_keys takes a 1-D label array, got shape {x.shape}")
    if x.size < h:
        return np.zeros(0, dtype=np.int64)
    if variant == "hashtable":
        raw = _window_product(x, h)
    else:
        raw = _window_weighted_sum(x, order_sensitive_coefficients(h))
    return np.remainder(raw.view(np.int64), np.int64(TABLE_SIZE))


def goldfish_drop(
    labels: Any,
    k: int = 50,
    h: int = 50,
    variant: str = "hashtable",
    spec: VocabSpec | None = None,
    *,
    exempt: Any = None,
    context: Any = None,
) -> Any:
    """Which label positions Goldfish drops: a boolean array shaped like ``labels`` (True = drop).

    Args:
        labels: label ids, 1-D ``(L,)`` or 2-D ``(B, L)`` (rows are independent sequences); a numpy
            array, a sequence, or a torch tensor (then a torch bool tensor on the same device returns).
        k: drop rate about ``1/k`` (``k <= 0`` disables dropping).
        h: window width; positions ``j < h-1`` never drop (no complete window).
        variant: ``"hashtable"`` or ``"order-sensitive"`` (see the module docstring).
        spec: vocabulary spec whose special ids and omni block are exempt (default: the released layout, ``vocab.default_spec()``).
        exempt: an explicit boolean lookup table over ids (True = never drops) instead of ``spec``'s.
        context: the labels that precede ``labels`` in the same sequence (1-D, or 2-D with one row per
            row of ``labels``); its last ``h-1`` entries complete the first windows, so slicing a
            sequence and passing each slice its preceding labels gives the same drops as the whole.
    """
    arr, src = _to_numpy(labels)
    if arr.ndim == 2:
        ctx_rows = None
        if context is not None:
            ctx_arr, _ = _to_numpy(context)
            ctx_rows = ctx_arr if ctx_arr.ndim == 2 else np.broadcast_to(ctx_arr, (arr.shape[0], ctx_arr.shape[-1]))
        rows = [
            goldfish_drop(arr[b], k, h, variant, spec, exempt=exempt, context=None if ctx_rows is None else ctx_rows[b])
            for b in range(arr.shape[0])
        ]
        out = np.stack(rows) if rows else np.zeros(arr.shape, dtype=bool)
        return _like(out, src)
    if arr.ndim != 1:
        raise ValueError(f"labels must be 1-D or 2-D, got shape {arr.shape}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown goldfish variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    x = arr.astype(np.int64, copy=False)
    n = x.size
    drop = np.zeros(n, dtype=bool)
    if k <= 0 or n == 0:
        return _like(drop, src)
    pre = 0
    if context is not None and h > 1:
        ctx = np.asarray(_to_numpy(context)[0], dtype=np.int64).reshape(-1)[-(h - 1) :]
        pre = ctx.size
        x = np.concatenate([ctx, x])
    keys = goldfish_keys(x, h, variant)
    if keys.size:
        hit = goldfish_table()[keys] < np.float32(1.0 / k)
        # window s ends at position s+h-1 of x, i.e. position s+h-1-pre of labels
        first = h - 1 - pre
        if first >= 0:
            drop[first:] = hit
        else:
            drop[:] = hit[-first:]
    if exempt is None:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            raise ValueError(f"labels must be non-negative ids, found {lo}")
        table = exempt_table(spec or default_spec(), hi + 1)
    else:
        table = np.asarray(exempt, dtype=bool)
        if int(arr.max()) >= table.size:
            table = np.concatenate([table, np.zeros(int(arr.max()) + 1 - table.size, dtype=bool)])
    drop &= ~table[arr.astype(np.int64, copy=False)]
    return _like(drop, src)



