"""The core's targets and indexed format against megatron-core 0.16.1 and torch.

* megatron-core's own ``IndexedDatasetBuilder`` writes what the core's reader reads identically, and
  the core's writer writes what megatron-core's ``IndexedDataset`` reads identically (byte for byte).
* The Goldfish table shipped with the package equals the one torch regenerates, bit for bit, and
  the hash keys equal torch's own int64 ``unfold().prod() % 1_000_003``.
* The SFT mask, Goldfish drops and pretraining weights on torch tensors equal the numpy results.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from apertus_plugins.core.goldfish import TABLE_SEED, TABLE_SIZE, goldfish_drop, goldfish_keys, goldfish_table
from apertus_plugins.core.targets import pretraining_targets, sft_mask
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype

SPEC = VocabSpec()


def random_docs(seed: int, n: int = 40, vocab: int = SPEC.size) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, vocab, int(rng.integers(0, 60))) for _ in range(int(rng.integers(1, 4)))]
            for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
@pytest.mark.parametrize("multimodal", [False, True])
def test_megatron_builder_core_reader(tmp_path: Path, dtype: type, multimodal: bool) -> None:
    vocab = 60000 if dtype is np.uint16 else SPEC.size
    docs = random_docs(1, vocab=vocab)
    prefix = str(tmp_path / "mc")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for d, seqs in enumerate(docs):
        if d % 2:
            builder.add_document(torch.from_numpy(np.concatenate(seqs)), [len(s) for s in seqs],
                                 modes=[d % 3] * len(seqs) if multimodal else None)
        else:
            for s in seqs:
                builder.add_item(torch.from_numpy(s), mode=1)
            builder.end_document()
    builder.finalize(prefix + ".idx")
    ref = MegatronIndexedDataset(prefix, multimodal=multimodal)
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.dtype(dtype) and len(ours) == len(ref)
    assert np.array_equal(ours.sequence_lengths, ref.sequence_lengths)
    assert np.array_equal(ours.document_indices, ref.document_indices)
    if multimodal:
        assert np.array_equal(ours.sequence_modes, ref.index.sequence_modes)  # (its property asserts on an array)
    for i in range(len(ref)):
        a = ref[i][0] if multimodal else ref[i]
        assert np.array_equal(ours[i], a) and ours[i].dtype == a.dtype
    for d, seqs in enumerate(docs):
        assert ours.document(d).tolist() == np.concatenate(seqs).tolist()


@pytest.mark.parametrize("dtype", [np.int32, np.uint16])
def test_core_writer_megatron_reader(tmp_path: Path, dtype: type) -> None:
    vocab = 60000 if dtype is np.uint16 else SPEC.size
    docs = random_docs(2, vocab=vocab)
    with IndexedDatasetWriter(tmp_path / "core", dtype) as w:
        for seqs in docs:
            w.add_document(np.concatenate(seqs), lengths=[len(s) for s in seqs])
    builder = IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=dtype)
    for seqs in docs:
        builder.add_document(torch.from_numpy(np.concatenate(seqs)), [len(s) for s in seqs])
    builder.finalize(str(tmp_path / "mc.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"core{ext}").read_bytes() == (tmp_path / f"mc{ext}").read_bytes()
    ref = MegatronIndexedDataset(str(tmp_path / "core"))
    flat = [s for seqs in docs for s in seqs]
    assert len(ref) == len(flat)
    for i, s in enumerate(flat):
        assert ref[i].tolist() == s.tolist() and ref[i].dtype == np.dtype(dtype)
    assert ref.get(3, offset=1, length=2).tolist() == flat[3][1:3].tolist()
    assert optimal_dtype(SPEC.size) is np.int32


def test_goldfish_table_bit_for_bit() -> None:
    regenerated = torch.rand(TABLE_SIZE, generator=torch.Generator().manual_seed(TABLE_SEED)).numpy()
    shipped = goldfish_table()
    assert regenerated.dtype == shipped.dtype == np.float32
    assert np.array_equal(regenerated.view(np.uint32), shipped.view(np.uint32))


@pytest.mark.parametrize("h", [1, 2, 5, 50])
def test_goldfish_hashtable_matches_torch_public_rule(h: int) -> None:
    """The public rule in torch: int64 window product (wrapping), % 1,000,003, table < 1/k."""
    rng = np.random.default_rng(h)
    labels = torch.from_numpy(rng.integers(0, SPEC.size, (3, 700)))
    table = torch.rand(TABLE_SIZE, generator=torch.Generator().manual_seed(TABLE_SEED))
    keys = labels.unfold(1, h, 1).prod(dim=-1) % TABLE_SIZE
    want = torch.zeros_like(labels, dtype=torch.bool)
    want[:, h - 1 :] = table[keys] < 1 / 50
    special = torch.tensor(sorted(SPEC.special_ids))
    want &= ~torch.isin(labels, special)
    for b in range(3):
        assert goldfish_keys(labels[b].numpy(), h).tolist() == keys[b].tolist()
    got = goldfish_drop(labels, k=50, h=h, spec=SPEC)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bool
    assert torch.equal(got, want)


def test_torch_tensors_equal_numpy() -> None:
    rng = np.random.default_rng(3)
    I = SPEC.id  # noqa: E741
    pool = np.array([I("bos"), I("eos"), I("user_start"), I("user_end"), I("assistant_start"), I("assistant_end"),
                     I("tool_output_start"), I("tool_output_end"), I("inner_prefix"), I("stt_transcribe"),
                     SPEC.modalities[0].offset + 5, SPEC.modalities[1].offset + 1, 100, 200, 300, 400])
    ids = rng.choice(pool, (4, 300))
    t = torch.from_numpy(ids)
    m_np, m_t = sft_mask(ids, SPEC), sft_mask(t, SPEC)
    assert isinstance(m_t, torch.Tensor) and m_t.dtype == torch.bool
    assert m_t.numpy().tolist() == m_np.tolist()
    for variant in ("hashtable", "order-sensitive"):
        g_np = goldfish_drop(ids[:, 1:], k=3, h=4, variant=variant, spec=SPEC)
        g_t = goldfish_drop(t[:, 1:], k=3, h=4, variant=variant, spec=SPEC)
        assert g_t.numpy().tolist() == g_np.tolist()
    w_np = pretraining_targets(ids, SPEC, "text-only", goldfish={"k": 3, "h": 4})
    w_t = pretraining_targets(t, SPEC, "text-only", goldfish={"k": 3, "h": 4})
    assert w_t.weights.dtype == torch.float32
    assert np.array_equal(w_t.weights.numpy(), w_np.weights)
    assert np.array_equal(w_t.modality.numpy(), w_np.modality)
