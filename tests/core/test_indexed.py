"""The numpy reader and writer of Megatron's indexed dataset format."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from apertus_plugins.data.indexed import (
    MAGIC,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    optimal_dtype,
    write_indexed_dataset,
)


def handmade(prefix: Path, seqs: list[list[int]], doc_idx: list[int], dtype: type = np.int32, code: int = 4) -> None:
    """Write the format byte by byte from the layout description, independently of the writer."""
    data = b"".join(np.asarray(s, dtype=dtype).tobytes() for s in seqs)
    prefix.with_suffix(".bin").write_bytes(data)
    lengths = [len(s) for s in seqs]
    item = np.dtype(dtype).itemsize
    ptrs = [sum(lengths[:i]) * item for i in range(len(seqs))]
    idx = MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx))
    idx += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(ptrs)}q", *ptrs)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    prefix.with_suffix(".idx").write_bytes(idx)


def test_read_handmade(tmp_path: Path) -> None:
    seqs = [[1, 2, 3], [4], [5, 6], [70000, 8]]
    handmade(tmp_path / "d", seqs, [0, 2, 3, 4])
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == 4 and ds.num_documents == 3 and ds.num_tokens == 8 and ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(4)] == seqs
    assert ds.document(0).tolist() == [1, 2, 3, 4] and ds.document(2).tolist() == [70000, 8]
    assert ds.get(0, offset=1, length=2).tolist() == [2, 3]
    assert ds.document_lengths().tolist() == [4, 2, 2]
    assert ds[-1].tolist() == [70000, 8]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_writer_roundtrip_bytes_match_handmade(tmp_path: Path, dtype: type) -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 200, int(rng.integers(0, 50))).tolist() for _ in range(30)]
    with IndexedDatasetWriter(tmp_path / "w", dtype) as w:
        for s in seqs[:10]:
            w.add_document(s)
        w.add_document(sum(seqs[10:13], []), lengths=[len(s) for s in seqs[10:13]])
        for s in seqs[13:]:
            w.add_item(s)
        w.end_document()
    codes = {np.uint8: 1, np.int32: 4, np.int64: 5, np.uint16: 8}
    handmade(tmp_path / "h", seqs, [*range(11), 13, 30], dtype, codes[dtype])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w{ext}").read_bytes() == (tmp_path / f"h{ext}").read_bytes()
    ds = IndexedDataset(tmp_path / "w", mmap=False)
    assert [ds[i].tolist() for i in range(len(ds))] == seqs
    assert not list(tmp_path.glob("*.tmp*"))


def test_writer_checks_and_abort(tmp_path: Path) -> None:
    with pytest.raises(IndexedDatasetError, match="uint16"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([70000])
    assert not list(tmp_path.iterdir())  # aborted: nothing left behind
    with pytest.raises(IndexedDatasetError, match="sum"):
        with IndexedDatasetWriter(tmp_path / "y") as w:
            w.add_document([1, 2, 3], lengths=[1, 1])
    assert optimal_dtype(512) is np.uint16 and optimal_dtype(266_440) is np.int32


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    write_indexed_dataset(tmp_path / "g", [[1, 2, 3], [4, 5]])
    with pytest.raises(IndexedDatasetError, match=r"missing\.idx: no such file"):
        IndexedDataset(tmp_path / "missing")
    idx = (tmp_path / "g.idx").read_bytes()
    (tmp_path / "m.bin").write_bytes((tmp_path / "g.bin").read_bytes())
    (tmp_path / "m.idx").write_bytes(b"NOTANIDX!" + idx[9:])
    with pytest.raises(IndexedDatasetError, match=r"m\.idx: bad magic"):
        IndexedDataset(tmp_path / "m")
    (tmp_path / "m.idx").write_bytes(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    with pytest.raises(IndexedDatasetError, match="version"):
        IndexedDataset(tmp_path / "m")
    (tmp_path / "m.idx").write_bytes(idx[:17] + b"\x63" + idx[18:])
    with pytest.raises(IndexedDatasetError, match="dtype code"):
        IndexedDataset(tmp_path / "m")
    (tmp_path / "m.idx").write_bytes(idx[:-4])
    with pytest.raises(IndexedDatasetError, match=r"m\.idx: .* bytes"):
        IndexedDataset(tmp_path / "m")
    (tmp_path / "m.idx").write_bytes(idx[:5])
    with pytest.raises(IndexedDatasetError, match="too short"):
        IndexedDataset(tmp_path / "m")
    (tmp_path / "m.idx").write_bytes(idx)
    (tmp_path / "m.bin").write_bytes((tmp_path / "g.bin").read_bytes()[:-4])
    with pytest.raises(IndexedDatasetError, match=r"m\.bin: 16 bytes"):
        IndexedDataset(tmp_path / "m")
    ds = IndexedDataset(tmp_path / "g")
    with pytest.raises(IndexedDatasetError, match=r"g\.idx: document index 5 out of range"):
        ds.document(5)
    with pytest.raises(IndexedDatasetError, match="sequence index"):
        ds[2]
    with pytest.raises(IndexedDatasetError, match="outside"):
        ds.get(0, offset=2, length=5)


def test_empty_and_multimodal_modes(tmp_path: Path) -> None:
    write_indexed_dataset(tmp_path / "e", [])
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_documents == 0
    with IndexedDatasetWriter(tmp_path / "mm", multimodal=True) as w:
        w.add_item([1, 2], mode=1)
        w.add_item([3], mode=0)
        w.end_document()
    ds = IndexedDataset(tmp_path / "mm")
    assert ds.sequence_modes is not None and ds.sequence_modes.tolist() == [1, 0]
    assert ds.document(0).tolist() == [1, 2, 3]
