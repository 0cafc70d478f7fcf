"""Packing documents into fixed-capacity sequences (SPEC.md 4.1, 4.2).

* :func:`best_fit_decreasing`: BFD bins (long-context pretraining and SFT): sort the documents by
  length, longest first (ties: lower document index first), and put each into the open bin with the
  least remaining room that still fits it (ties: the bin opened first); if none fits, open a bin.
* :func:`concat_sample_index`: the pretraining variant of Megatron's ``GPTDataset``: documents
  concatenated in the given order and cut into samples of ``seq_length`` inputs (plus one extra
  token for the last label, shared with the next sample).
* :func:`packed_layout` / :func:`packed_layout_from_eod`: per-token document ids, position ids that
  reset at each document boundary, the cross-document loss exclusion and ``cu_seqlens`` for
  packed-sequence (varlen) attention.
* :func:`pad_to_multiple`, :func:`cp_partition_indices`: context parallelism over packed
  sequences, as Transformer Engine's THD attention splits them: every sequence padded to a
  multiple of ``2 * cp``, cut into ``2 * cp`` chunks, rank ``r`` holding chunks ``r`` and
  ``2 * cp - 1 - r`` of each (the load-balanced order for causal attention).
* :class:`PackingConfig`: a training run's packing settings (which prefixes are packed, how long
  conversations are handled, packed-sequence attention, the padding multiple), built once from the
  framework's flags and handed down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = [
    "PackingConfig",
    "SFT_OVERSIZE",
    "BinPacking",
    "best_fit_decreasing",
    "concat_sample_index",
    "PackedLayout",
    "packed_layout",
    "packed_layout_from_eod",
    "pad_to_multiple",
    "cp_partition_indices",
]

Oversize = Literal["error", "own_bin", "split"]
#: What a training run does with a conversation longer than a sample (``PackingConfig.sft_oversize``).
SFT_OVERSIZE = ("error", "split")


@dataclass(frozen=True)
class PackingConfig:
    """How a training run's documents become samples, one documented field each (SPEC.md 4.1, 4.2).

    Built once from Megatron's flags (:func:`megatron_patches.arguments.options_from_args`:
    ``--apertus-sft-data``, ``--apertus-bfd-data``, ``--apertus-sft-oversize``,
    ``--apertus-packed-sequences``, ``--apertus-pad-to-multiple``), or by hand, and handed down to
    the dataset that packs (``megatron_patches.dataset.ApertusDataset``), the forward step that reads
    the batches and the preflight that checks the blend. The sequence length stays the framework's
    own setting (Megatron's ``--seq-length``); the methods that depend on it take it.

    A prefix not named in :attr:`sft_prefixes` or :attr:`bfd_prefixes` is pretraining data that the
    framework concatenates and cuts into samples as it always does (documents kept apart by the
    cross-document rule of :mod:`apertus_plugins.core.targets`). Prefixes are compared after
    ``os.path.normpath``.
    """

    sft_prefixes: tuple[str, ...] = ()
    """Prefixes of one tokenized conversation per sequence: packed best-fit-decreasing, SFT loss mask."""
    bfd_prefixes: tuple[str, ...] = ()
    """Pretraining prefixes whose whole documents are packed best-fit-decreasing with cross-document
    masking (the long-context stages), instead of concatenated and cut."""
    sft_oversize: str = "error"
    """A conversation longer than a sample: ``"error"`` (the default) or ``"split"`` into pieces. Packed
    pretraining documents are always split."""
    packed_sequences: bool = False
    """Samples carry ``cu_seqlens`` for packed-sequence (THD) attention instead of an ``[S, S]`` mask."""
    pad_multiple: int = 1
    """With :attr:`packed_sequences`, every packed document takes a multiple of this many positions
    (``2 x CP`` under context parallelism); 1 pads nothing, and is the only value without them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sft_prefixes", tuple(os.path.normpath(p) for p in self.sft_prefixes))
        object.__setattr__(self, "bfd_prefixes", tuple(os.path.normpath(p) for p in self.bfd_prefixes))
        both = sorted(set(self.sft_prefixes) & set(self.bfd_prefixes))
        if both:
            raise ValueError(f"sft_prefixes and bfd_prefixes both name {', '.join(both)}: a prefix holds either "
                             "pretraining documents or conversations")
        if self.sft_oversize not in SFT_OVERSIZE:
            raise ValueError(f"sft_oversize must be one of {', '.join(SFT_OVERSIZE)}, got {self.sft_oversize!r}")
        if int(self.pad_multiple) < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {self.pad_multiple}")
        if self.pad_multiple > 1 and not self.packed_sequences:
            raise ValueError(f"pad_multiple {self.pad_multiple}: only packed sequences are padded")

    def is_sft(self, prefix: str | None) -> bool:
        """Whether ``prefix`` holds conversations (one of :attr:`sft_prefixes`)."""
        return prefix is not None and os.path.normpath(prefix) in self.sft_prefixes

    def is_bfd(self, prefix: str | None) -> bool:
        """Whether ``prefix`` holds pretraining documents packed whole (one of :attr:`bfd_prefixes`)."""
        return prefix is not None and os.path.normpath(prefix) in self.bfd_prefixes

    @property
    def padded(self) -> bool:
        """Whether packed documents are padded (:attr:`pad_multiple` > 1)."""
        return self.pad_multiple > 1

    def capacity(self, seq_length: int) -> int:
        """Tokens a packed sample holds: ``seq_length + 1`` (the last token only a label), or ``seq_length``
        when documents are padded (a piece of ``n`` tokens takes ``pad(n)`` of the ``seq_length`` inputs)."""
        return int(seq_length) + (0 if self.padded else 1)

    def oversize(self, prefix: str | None) -> Oversize:
        """What :func:`best_fit_decreasing` does with a document of ``prefix`` longer than a sample."""
        if self.is_sft(prefix) and self.sft_oversize == "error":
            return "error"
        return "split"

    def slots(self, lengths: Any) -> np.ndarray:
        """The positions each document of ``lengths`` takes in a sample (:func:`pad_to_multiple` when padded)."""
        lens = np.asarray(lengths, dtype=np.int64)
        return pad_to_multiple(lens, self.pad_multiple) if self.padded else lens

    def describe(self) -> list[str]:
        """What the packing does, as phrases for a run's start-up line (empty when nothing is packed)."""
        parts = []
        if self.bfd_prefixes:
            parts.append(f"best-fit-decreasing pretraining prefixes {list(self.bfd_prefixes)}")
        if self.packed_sequences:
            parts.append("packed sequences (THD cu_seqlens)" + (
                f", documents padded to multiples of {self.pad_multiple}" if self.padded else ""))
        return parts


@dataclass(frozen=True)
class BinPacking:
    """The result of :func:`best_fit_decreasing`, as pieces in placement order.

    A piece is a whole document unless ``oversize="split"`` cut it. Piece ``i`` is tokens
    ``piece_start[i] : piece_start[i] + piece_length[i]`` of document ``piece_doc[i]``, placed in bin
    ``piece_bin[i]``; within a bin, pieces appear in placement order.
    """

    capacity: int
    num_bins: int
    piece_doc: np.ndarray
    piece_start: np.ndarray
    piece_length: np.ndarray
    piece_bin: np.ndarray

    def bin_lengths(self) -> np.ndarray:
        """Tokens used per bin (int64)."""
        return np.bincount(self.piece_bin, weights=self.piece_length, minlength=self.num_bins).astype(np.int64)

    def bins(self) -> list[list[int]]:
        """The document indices of each bin, in placement order (for small inputs and tests)."""
        order = np.argsort(self.piece_bin, kind="stable")
        bounds = np.searchsorted(self.piece_bin[order], np.arange(self.num_bins + 1))
        docs = self.piece_doc[order]
        return [docs[bounds[b] : bounds[b + 1]].tolist() for b in range(self.num_bins)]

    def doc_bin(self) -> np.ndarray:
        """For unsplit packings: the bin of each document (int64, by document index)."""
        out = np.full(int(self.piece_doc.max(initial=-1)) + 1, -1, dtype=np.int64)
        out[self.piece_doc] = self.piece_bin
        return out


class _RoomLists:
    """Open bins grouped by remaining room; each group's bin ids kept sorted on demand."""

    def __init__(self, capacity: int) -> None:
        self.chunks: list[list[np.ndarray]] = [[] for _ in range(capacity + 1)]
        self.sorted_ok = np.ones(capacity + 1, dtype=bool)
        self.nonempty = np.zeros(capacity + 1, dtype=bool)

    def add(self, room: int, bins: np.ndarray) -> None:
        if bins.size == 0 or room == 0:
            return  # full bins are never candidates
        lst = self.chunks[room]
        if lst:
            self.sorted_ok[room] = False
        lst.append(bins)
        self.nonempty[room] = True

    def smallest_at_least(self, length: int) -> int:
        """The smallest room >= length with an open bin, or -1."""
        tail = self.nonempty[length:]
        r = int(tail.argmax())
        return length + r if tail[r] else -1

    def take_all(self, room: int) -> np.ndarray:
        lst = self.chunks[room]
        bins = lst[0] if len(lst) == 1 else np.concatenate(lst)
        if not self.sorted_ok[room]:
            bins = np.sort(bins)
        self.chunks[room] = []
        self.sorted_ok[room] = True
        self.nonempty[room] = False
        return bins


def best_fit_decreasing(lengths: Any, capacity: int, *, oversize: Oversize = "error") -> BinPacking:
    """Pack documents of the given lengths into bins of ``capacity`` tokens, best-fit-decreasing.

    Args:
        lengths: integer document lengths (each >= 1).
        capacity: tokens per bin.
        oversize: a document longer than ``capacity``: ``"error"`` raises, ``"own_bin"`` gives it a
            bin of its own (over capacity, never shared), ``"split"`` cuts it into pieces of
            ``capacity`` tokens (each its own bin) and a remainder that is packed like a document.

    Equal lengths are placed in bulk: a bin whose room ``r`` is the best fit for a length ``n``
    stays the best fit for the following ``r // n`` documents of that length, so the work is per
    (length, room) pair, not per document.
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if lens.size and int(lens.min()) < 1:
        raise ValueError(f"document lengths must be >= 1, found {int(lens.min())} (document {int(lens.argmin())})")
    if oversize not in ("error", "own_bin", "split"):
        raise ValueError(f"oversize must be error, own_bin or split, got {oversize!r}")
    docs = np.arange(lens.size, dtype=np.int64)
    starts = np.zeros(lens.size, dtype=np.int64)
    over = lens > capacity
    if over.any() and oversize == "error":
        d = int(np.flatnonzero(over)[0])
        raise ValueError(f"document {d} has {int(lens[d])} tokens, more than the capacity {capacity}")
    if over.any() and oversize == "split":
        full = lens // capacity
        rem = lens % capacity
        count = full + (rem > 0)
        docs = np.repeat(docs, count)
        first = np.cumsum(count) - count
        k = np.arange(docs.size, dtype=np.int64) - np.repeat(first, count)
        starts = k * capacity
        lens = np.minimum(capacity, np.repeat(lens, count) - starts)
    order = np.lexsort((starts, docs, -lens))  # longest first; ties by document, then piece
    p_doc, p_start, p_len = docs[order], starts[order], lens[order]
    p_bin = np.empty(p_len.size, dtype=np.int64)

    rooms = _RoomLists(capacity)
    next_bin = 0
    n_over = int(np.count_nonzero(p_len > capacity))
    if n_over:  # only with oversize="own_bin": they sort first, one bin each
        p_bin[:n_over] = np.arange(n_over)
        next_bin = n_over
    # groups of equal length, longest first
    seg_len = p_len[n_over:]
    if seg_len.size:
        change = np.flatnonzero(seg_len[1:] != seg_len[:-1]) + 1
        g_start = np.concatenate([[0], change]) + n_over
        g_end = np.concatenate([change, [seg_len.size]]) + n_over
    else:
        g_start = g_end = np.zeros(0, dtype=np.int64)
    for s, e in zip(g_start.tolist(), g_end.tolist(), strict=True):
        length = int(p_len[s])
        pos = s
        while pos < e:
            room = rooms.smallest_at_least(length)
            remaining = e - pos
            if room < 0:  # open new bins: each takes capacity // length documents
                per = capacity // length
                n_bins = -(-remaining // per)
                new = np.arange(next_bin, next_bin + n_bins, dtype=np.int64)
                next_bin += n_bins
                p_bin[pos:e] = np.repeat(new, per)[:remaining]
                n_full = remaining // per
                rooms.add(capacity - per * length, new[:n_full])
                if n_full < n_bins:
                    rooms.add(capacity - (remaining - n_full * per) * length, new[n_full:])
                pos = e
                continue
            bins = rooms.take_all(room)
            per = room // length
            n_use = min(bins.size, -(-remaining // per))
            placed = min(remaining, n_use * per)
            p_bin[pos : pos + placed] = np.repeat(bins[:n_use], per)[:placed]
            n_full = placed // per
            rooms.add(room - per * length, bins[:n_full])
            if n_full < n_use:
                rooms.add(room - (placed - n_full * per) * length, bins[n_full:n_use])
            if n_use < bins.size:
                rooms.add(room, bins[n_use:])
            pos += placed
    return BinPacking(capacity, next_bin, p_doc, p_start, p_len, p_bin)


def concat_sample_index(lengths: Any, seq_length: int, *, add_extra_token: bool = True) -> np.ndarray:
    """Cut documents concatenated in the given order into samples, as Megatron's ``GPTDataset``.

    Returns an int64 array of shape ``(num_samples + 1, 2)``: row ``i`` is ``(document position,
    offset)`` where sample ``i`` starts; sample ``i`` spans the tokens from row ``i`` up to row
    ``i+1`` plus, with ``add_extra_token``, one token more (its last label, which is also the first
    input of the next sample). ``num_samples = (total - add_extra_token) // seq_length``.
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    total = int(lens.sum())
    extra = 1 if add_extra_token else 0
    num_samples = max((total - extra) // seq_length, 0)
    token_starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    if num_samples == 0:
        return out
    ends = np.cumsum(lens)
    # sample i >= 1 starts in the document holding the last token sample i-1 consumes (with the
    # extra token that is token i*seq_length itself), as Megatron's build_sample_idx walks
    last = token_starts[1:] + extra - 1
    doc = np.searchsorted(ends, last, side="right")
    out[1:, 0] = doc
    out[1:, 1] = token_starts[1:] - (ends[doc] - lens[doc])
    return out


@dataclass(frozen=True)
class PackedLayout:
    """Per-token layout of one packed sequence of ``S`` input tokens.

    Attributes:
        document_ids: int32 ``(S,)``, the index of the document each input token belongs to.
        position_ids: int64 ``(S,)``, restarting at 0 at each document.
        loss_mask: float32 ``(S,)`` per input position (its label is the next token): 0 where the
            label crosses into the next document, 1 elsewhere.
        cu_seqlens: int32 ``(D+1,)``, cumulative document lengths starting at 0 and ending at ``S``.
    """

    document_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray


def _layout_from_lengths(seg: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cu = np.zeros(seg.size + 1, dtype=np.int64)
    np.cumsum(seg, out=cu[1:])
    doc_ids = np.repeat(np.arange(seg.size, dtype=np.int32), seg)
    pos = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], seg)
    return doc_ids, pos, cu


def packed_layout(doc_lengths: Any, *, last_continues: bool = False) -> PackedLayout:
    """The layout of a sequence made of documents of the given lengths, back to back.

    The last input of each document predicts the first token of the next one: its loss is masked.
    ``last_continues=True`` says the final document goes on past the sequence (the pretraining
    concatenation, where the extra token belongs to it), keeping its last position trained.
    """
    seg = np.asarray(doc_lengths, dtype=np.int64).reshape(-1)
    if seg.size and int(seg.min()) < 1:
        raise ValueError("document lengths must be >= 1")
    total = int(seg.sum())
    doc_ids, pos, cu = _layout_from_lengths(seg, total)
    loss = np.ones(total, dtype=np.float32)
    last = cu[1:] - 1
    if last_continues and last.size:
        last = last[:-1]
    loss[last] = 0.0
    return PackedLayout(doc_ids, pos, loss, cu.astype(np.int32))


def packed_layout_from_eod(tokens: Any, eod_id: int) -> PackedLayout:
    """The layout of a packed input sequence whose documents end with the token ``eod_id``.

    As Megatron's ``get_ltor_masks_and_position_ids`` with position and attention resets: a new
    document starts after each ``eod_id``; the position whose input is ``eod_id`` is masked.
    """
    tok = np.asarray(tokens).reshape(-1)
    total = tok.size
    ends = np.flatnonzero(tok == eod_id) + 1
    ends = ends[ends < total]
    bounds = np.concatenate([[0], ends, [total]]) if total else np.zeros(1, dtype=np.int64)
    seg = np.diff(bounds)
    doc_ids, pos, cu = _layout_from_lengths(seg, total)
    loss = np.ones(total, dtype=np.float32)
    loss[tok == eod_id] = 0.0
    return PackedLayout(doc_ids, pos, loss, cu.astype(np.int32))


# ------------------------------------------------------------------------------------ context parallelism
def pad_to_multiple(lengths: Any, multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``multiple`` (int64; ``multiple=1`` leaves them unchanged)."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if int(multiple) < 1:
        raise ValueError(f"the padding multiple must be >= 1, got {multiple}")
    m = np.int64(multiple)
    return -(-lens // m) * m


def cp_partition_indices(cu_seqlens: Any, cp_size: int, cp_rank: int) -> np.ndarray:
    """The positions of a packed sequence that context-parallel rank ``cp_rank`` of ``cp_size`` holds.

    ``cu_seqlens`` are the (padded) sequence boundaries, from 0 to the total length; every
    sequence length must be a multiple of ``2 * cp_size``. Sequence ``i`` of length ``L`` is cut
    into ``2 * cp_size`` chunks of ``c = L / (2 * cp_size)`` positions; the rank holds chunk
    ``cp_rank`` and chunk ``2 * cp_size - 1 - cp_rank`` of every sequence, in sequence order:
    Transformer Engine's ``thd_get_partitioned_indices`` (and megatron-core's per-document
    ``get_batch_on_this_cp_rank``). Returns int64 indices, ``total / cp_size`` of them, ascending
    within each chunk. The rank's own sequences then have boundaries ``cu_seqlens // cp_size``.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    cp, rank = int(cp_size), int(cp_rank)
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {cp_rank} of size {cp_size} is not a rank")
    if cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu.tolist()[:8]}...")
    lengths = np.diff(cu)
    bad = np.flatnonzero(lengths % (2 * cp))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i} has {int(lengths[i])} positions, not a multiple of 2 * cp = {2 * cp}: pad "
                         "each packed sequence (pad_to_multiple) before splitting it over context-parallel ranks")
    chunk = lengths // (2 * cp)
    # two runs per sequence: [start + rank*c, +c) and [start + (2cp-1-rank)*c, +c)
    run_start = np.stack([cu[:-1] + rank * chunk, cu[:-1] + (2 * cp - 1 - rank) * chunk], axis=1).reshape(-1)
    run_len = np.repeat(chunk, 2)
    total = int(run_len.sum())
    offsets = np.cumsum(run_len) - run_len
    return np.repeat(run_start - offsets, run_len) + np.arange(total, dtype=np.int64)
