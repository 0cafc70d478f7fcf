"""Best-fit-decreasing packing and packed-sequence layouts against naive references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apertus_plugins.core.packing import (
    PackingConfig,
    best_fit_decreasing,
    concat_sample_index,
    cp_partition_indices,
    packed_layout,
    packed_layout_from_eod,
    pad_to_multiple,
)


def naive_bfd(lengths: list[int], capacity: int, oversize: str = "own_bin") -> list[list[int]]:
    """O(n * bins): longest first (ties by index); the fullest bin that fits (ties: the older bin)."""
    pieces = []
    for d, n in enumerate(lengths):
        if n > capacity and oversize == "split":
            start = 0
            while start < n:
                pieces.append((min(capacity, n - start), d, start))
                start += capacity
        else:
            pieces.append((n, d, 0))
    pieces.sort(key=lambda p: (-p[0], p[1], p[2]))
    bins: list[list[int]] = []
    room: list[int] = []
    for n, d, _ in pieces:
        if n > capacity:
            bins.append([d])
            room.append(0)
            continue
        best = -1
        for b, r in enumerate(room):
            if r >= n and (best < 0 or r < room[best]):
                best = b
        if best < 0:
            bins.append([])
            room.append(capacity)
            best = len(bins) - 1
        bins[best].append(d)
        room[best] -= n
    return bins


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=60), st.integers(1, 40))
def test_bfd_matches_naive_reference(lengths: list[int], capacity: int) -> None:
    lengths = [min(n, capacity) for n in lengths]
    got = best_fit_decreasing(lengths, capacity)
    assert got.bins() == naive_bfd(lengths, capacity)


@pytest.mark.parametrize("seed", range(30))
def test_bfd_random_against_reference_and_invariants(seed: int) -> None:
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 200))
    n = int(rng.integers(1, 400))
    lengths = np.minimum(rng.geometric(1 / rng.uniform(2, capacity / 2), n), capacity)
    p = best_fit_decreasing(lengths, capacity)
    assert p.bins() == naive_bfd(lengths.tolist(), capacity)
    assert sorted(p.piece_doc.tolist()) == list(range(n))  # every document placed once
    assert p.bin_lengths().max() <= capacity
    assert p.bin_lengths().sum() == lengths.sum()
    assert p.doc_bin()[p.piece_doc].tolist() == p.piece_bin.tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=40), st.integers(1, 30))
def test_oversize_options(lengths: list[int], capacity: int) -> None:
    split = best_fit_decreasing(lengths, capacity, oversize="split")
    assert split.bins() == naive_bfd(lengths, capacity, "split")
    assert split.bin_lengths().max(initial=0) <= capacity
    for d, n in enumerate(lengths):  # the pieces of each document tile it
        sel = split.piece_doc == d
        starts, lens = split.piece_start[sel], split.piece_length[sel]
        order = np.argsort(starts)
        assert np.array_equal(np.cumsum(lens[order]) - lens[order], starts[order])
        assert lens.sum() == n
    own = best_fit_decreasing(lengths, capacity, oversize="own_bin")
    assert own.bins() == naive_bfd(lengths, capacity, "own_bin")
    for b, docs in enumerate(own.bins()):
        if any(lengths[d] > capacity for d in docs):
            assert len(docs) == 1, b
    if any(n > capacity for n in lengths):
        with pytest.raises(ValueError, match="capacity"):
            best_fit_decreasing(lengths, capacity)


def test_bfd_errors_and_empty() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        best_fit_decreasing([3, 0], 8)
    with pytest.raises(ValueError, match="capacity"):
        best_fit_decreasing([3], 0)
    with pytest.raises(ValueError, match="oversize"):
        best_fit_decreasing([3], 5, oversize="drop")  # type: ignore[arg-type]
    p = best_fit_decreasing([], 8)
    assert p.num_bins == 0 and p.bins() == []


def test_bfd_large_bulk_path() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2049, 200_000)
    p = best_fit_decreasing(lengths, 2048)
    used = p.bin_lengths()
    assert used.max() <= 2048 and used.sum() == lengths.sum()
    assert np.bincount(p.piece_doc, minlength=lengths.size).max() == 1
    assert p.num_bins <= lengths.sum() / 2048 * 1.01 + 1


def naive_sample_index(lengths: list[int], seq_length: int, extra: int) -> list[list[int]]:
    """Megatron's build_sample_idx walk, one document at a time."""
    total = sum(lengths)
    num = (total - extra) // seq_length
    out = [[0, 0]]
    doc, offset = 0, 0
    for _ in range(num):
        remaining = seq_length + extra
        while remaining != 0:
            doc_len = lengths[doc] - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - extra
                remaining = 0
            else:
                doc += 1
                offset = 0
        out.append([doc, offset])
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=30), st.integers(1, 25), st.booleans())
def test_concat_sample_index_matches_megatron_walk(lengths: list[int], seq: int, extra: bool) -> None:
    got = concat_sample_index(lengths, seq, add_extra_token=extra)
    assert got.tolist() == naive_sample_index(lengths, seq, int(extra))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=0, max_size=20), st.booleans())
def test_packed_layout_consistency(lengths: list[int], last_continues: bool) -> None:
    lay = packed_layout(lengths, last_continues=last_continues)
    total = sum(lengths)
    assert lay.cu_seqlens.dtype == np.int32 and lay.cu_seqlens.tolist() == np.cumsum([0, *lengths]).tolist()
    pos, docs, loss = [], [], []
    for d, n in enumerate(lengths):
        pos += list(range(n))
        docs += [d] * n
        loss += [1.0] * (n - 1) + [1.0 if (last_continues and d == len(lengths) - 1) else 0.0]
    assert lay.position_ids.tolist() == pos and lay.document_ids.tolist() == docs
    assert lay.loss_mask.tolist() == loss and lay.loss_mask.size == total
    for d in range(len(lengths)):  # cu_seqlens bound each document's positions
        a, b = lay.cu_seqlens[d], lay.cu_seqlens[d + 1]
        assert (lay.document_ids[a:b] == d).all() and lay.position_ids[a] == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([2, 7, 8, 9]), max_size=40))
def test_layout_from_eod_matches_megatron_rule(tokens: list[int]) -> None:
    eod = 2
    lay = packed_layout_from_eod(np.array(tokens), eod)
    pos, docs, loss, cu = [], [], [], [0]
    p = d = 0
    for i, t in enumerate(tokens):
        pos.append(p)
        docs.append(d)
        loss.append(0.0 if t == eod else 1.0)
        p += 1
        if t == eod and i + 1 < len(tokens):
            p, d = 0, d + 1
            cu.append(i + 1)
    cu.append(len(tokens))
    assert lay.position_ids.tolist() == pos and lay.document_ids.tolist() == docs
    assert lay.loss_mask.tolist() == loss
    assert lay.cu_seqlens.tolist() == (cu if tokens else [0])


# ------------------------------------------------------------------------------------ context parallelism
def te_partition_reference(cu: list[int], cp: int, rank: int) -> list[int]:
    """Transformer Engine's rule token by token: the rank's local token t lies in sequence i (boundaries
    cu // cp); within it, the first half of the rank's tokens is chunk ``rank``, the second half chunk
    ``2 cp - 1 - rank`` of the sequence (each chunk a ``2 cp``-th of it), written as TE's kernel computes it."""
    local = [c // cp for c in cu]
    out = []
    for t in range(cu[-1] // cp):
        i = max(k for k in range(len(local) - 1) if local[k] <= t)
        half = (local[i + 1] - local[i]) // 2
        index = t - local[i]
        offset = rank if index < half else (cp - 1) * 2 - rank
        out.append(index + local[i] * cp + half * offset)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.sampled_from([1, 2, 3, 4, 8]))
def test_cp_partition_matches_the_te_rule(lengths: list[int], cp: int) -> None:
    padded = pad_to_multiple(lengths, 2 * cp)
    assert np.all(padded >= lengths) and np.all(padded % (2 * cp) == 0) and np.all(padded - lengths < 2 * cp)
    cu = np.concatenate([[0], np.cumsum(padded)])
    parts = [cp_partition_indices(cu, cp, r) for r in range(cp)]
    for r, idx in enumerate(parts):
        assert idx.tolist() == te_partition_reference(cu.tolist(), cp, r)
    # the ranks together hold every position once; rank r holds chunks r and 2cp-1-r of every sequence
    assert sorted(np.concatenate(parts).tolist()) == list(range(int(cu[-1])))
    for r, idx in enumerate(parts):
        for i in range(len(lengths)):
            c = int(padded[i]) // (2 * cp)
            mine = idx[(idx >= cu[i]) & (idx < cu[i + 1])] - cu[i]
            assert mine.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]


def test_cp_partition_errors() -> None:
    assert cp_partition_indices([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="sequence 1 has 6 positions, not a multiple of 2 \\* cp = 4"):
        cp_partition_indices([0, 4, 10], 2, 0)
    with pytest.raises(ValueError, match="is not a rank"):
        cp_partition_indices([0, 4], 2, 2)
    with pytest.raises(ValueError, match="start at 0"):
        cp_partition_indices([1, 4], 1, 0)
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        pad_to_multiple([3], 0)


# ------------------------------------------------------------------------------ the packing settings
def test_packing_config_answers_per_prefix() -> None:
    cfg = PackingConfig(sft_prefixes=("data/./sft",), bfd_prefixes=("data/long/",), sft_oversize="error")
    assert cfg.sft_prefixes == ("data/sft",) and cfg.bfd_prefixes == ("data/long",)  # compared normalized
    assert cfg.is_sft("data/sft") and cfg.is_sft("./data/sft") and not cfg.is_sft("data/long") and not cfg.is_sft(None)
    assert cfg.is_bfd("data//long") and not cfg.is_bfd("data/web")
    # conversations follow sft_oversize; packed pretraining documents always split
    assert cfg.oversize("data/sft") == "error" and cfg.oversize("data/long") == "split"
    assert PackingConfig(sft_prefixes=("s",), sft_oversize="split").oversize("s") == "split"
    assert cfg.describe() == ["best-fit-decreasing pretraining prefixes ['data/long']"]
    assert PackingConfig().describe() == []


def test_packing_config_capacity_and_slots() -> None:
    plain = PackingConfig()
    assert not plain.padded and plain.capacity(8) == 9  # S + 1 tokens: the last only a label
    assert plain.slots([3, 5]).tolist() == [3, 5]
    padded = PackingConfig(packed_sequences=True, pad_multiple=4)
    assert padded.padded and padded.capacity(8) == 8  # a piece of n tokens takes pad(n) of the S inputs
    assert padded.slots([3, 5, 8]).tolist() == [4, 8, 8]
    packed = best_fit_decreasing(padded.slots([3, 5, 8]), padded.capacity(8), oversize=padded.oversize("x"))
    assert sorted(packed.bin_lengths().tolist()) == [4, 8, 8]
    assert padded.describe() == ["packed sequences (THD cu_seqlens), documents padded to multiples of 4"]
    assert PackingConfig(packed_sequences=True).describe() == ["packed sequences (THD cu_seqlens)"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"sft_prefixes": ("a",), "bfd_prefixes": ("./a",)}, "both name a: a prefix holds either"),
    ({"sft_oversize": "own_bin"}, "sft_oversize must be one of error, split, got 'own_bin'"),
    ({"packed_sequences": True, "pad_multiple": 0}, "pad_multiple must be >= 1, got 0"),
    ({"pad_multiple": 2}, "pad_multiple 2: only packed sequences are padded"),
])
def test_packing_config_refuses_bad_settings(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackingConfig(**fields)
