"""Megatron's indexed dataset format (``PREFIX.bin`` + ``PREFIX.idx``), read and written with numpy only.

The ``.bin`` file is the tokens of every sequence back to back in one dtype. The ``.idx`` file is,
little-endian:

====================  ==========================================================
bytes                 content
====================  ==========================================================
9                     magic ``b"MMIDIDX\\x00\\x00"``
8 (uint64)            version, 1
1 (uint8)             dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                      6 float64, 7 float32, 8 uint16
8 (uint64)            sequence count ``S``
8 (uint64)            document-index count ``D+1``
4*S (int32)           sequence lengths (tokens)
8*S (int64)           sequence pointers (byte offsets into ``.bin``)
8*(D+1) (int64)       document indices: 0, then after each document the number of
                      sequences so far (document ``d`` is sequences
                      ``doc_idx[d] .. doc_idx[d+1]-1``)
S (int8), optional    sequence modes (multimodal datasets only)
====================  ==========================================================

Megatron's ``IndexedDatasetBuilder`` picks ``uint16`` for vocabularies below 65,500 ids and
``int32`` otherwise (:func:`optimal_dtype`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MAGIC",
    "VERSION",
    "DTYPE_CODES",
    "IndexedDatasetError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "optimal_dtype",
    "write_indexed_dataset",
    "bin_path",
    "idx_path",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")


class IndexedDatasetError(ValueError):
    """A missing, truncated or inconsistent ``.bin``/``.idx`` pair, or an index out of range."""


def bin_path(prefix: str | os.PathLike[str]) -> Path:
    """``PREFIX.bin``."""
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike[str]) -> Path:
    """``PREFIX.idx``."""
    return Path(f"{os.fspath(prefix)}.idx")


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """The token dtype Megatron's preprocessing chooses: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedDataset:
    """A read-only, memory-mapped Megatron indexed dataset.

    ``ds[i]`` is sequence ``i`` (a numpy view of the ``.bin`` file); :meth:`document` concatenates
    the sequences of a document. Opening checks the magic, version and dtype code, that the ``.idx``
    holds exactly the arrays its header announces (plus optional modes), and that the sequence
    pointers and lengths tile the ``.bin`` file exactly; every error names the file.
    """

    def __init__(self, prefix: str | os.PathLike[str], *, mmap: bool = True) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_file = idx_path(prefix)
        self.bin_file = bin_path(prefix)
        for f in (self.idx_file, self.bin_file):
            if not f.is_file():
                raise IndexedDatasetError(f"{f}: no such file (indexed dataset prefix {self.prefix!r})")
        idx = np.memmap(self.idx_file, mode="r", dtype=np.uint8) if self.idx_file.stat().st_size else None
        if idx is None or idx.size < _HEADER.size:
            raise IndexedDatasetError(f"{self.idx_file}: too short for an index header ({0 if idx is None else idx.size} bytes)")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(idx[: _HEADER.size]))
        if magic != MAGIC:
            raise IndexedDatasetError(f"{self.idx_file}: bad magic {magic!r}, expected {MAGIC!r} (not a Megatron .idx)")
        if version != VERSION:
            raise IndexedDatasetError(f"{self.idx_file}: unsupported index version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{self.idx_file}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        body = _HEADER.size + 12 * n_seq + 8 * n_doc
        if idx.size not in (body, body + n_seq):
            raise IndexedDatasetError(
                f"{self.idx_file}: {idx.size} bytes, but the header's {n_seq} sequences and {n_doc} document "
                f"indices need {body} (or {body + n_seq} with modes)"
            )
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=off)
        off += 8 * n_doc
        self.sequence_modes = np.frombuffer(idx, dtype=np.int8, count=n_seq, offset=off) if idx.size > body else None
        self._idx = idx
        self._check(n_seq, n_doc)
        size = self.bin_file.stat().st_size
        if size:
            self._bin: np.ndarray = (
                np.memmap(self.bin_file, mode="r", dtype=np.uint8) if mmap else np.fromfile(self.bin_file, dtype=np.uint8)
            )
        else:
            self._bin = np.zeros(0, dtype=np.uint8)

    def _check(self, n_seq: int, n_doc: int) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        size = self.bin_file.stat().st_size
        item = self.dtype.itemsize
        if n_seq and int(lengths.min()) < 0:
            raise IndexedDatasetError(f"{self.idx_file}: negative sequence length")
        expected = np.zeros(n_seq, dtype=np.int64)
        if n_seq:
            np.cumsum(lengths[:-1].astype(np.int64) * item, out=expected[1:])
        if not np.array_equal(pointers, expected):
            bad = int(np.flatnonzero(pointers != expected)[0])
            raise IndexedDatasetError(
                f"{self.idx_file}: sequence pointer {bad} is {int(pointers[bad])}, expected {int(expected[bad])} "
                "(pointers must tile the .bin file)"
            )
        need = int(lengths.astype(np.int64).sum()) * item
        if size != need:
            raise IndexedDatasetError(
                f"{self.bin_file}: {size} bytes, but {self.idx_file.name} describes {need} "
                f"({int(lengths.astype(np.int64).sum())} tokens of {self.dtype.name})"
            )
        if n_doc < 1 or int(docs[0]) != 0 or int(docs[-1]) > n_seq or (n_doc > 1 and bool(np.any(np.diff(docs) < 0))):
            raise IndexedDatasetError(
                f"{self.idx_file}: document indices must rise from 0 to at most the sequence count {n_seq}"
            )

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        """Number of sequences."""
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.astype(np.int64).sum())

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset+length`` of sequence ``i`` (a read-only view)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexedDatasetError(f"{self.idx_file}: sequence index {i} out of range (0..{n - 1})")
        i %= n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexedDatasetError(f"{self.idx_file}: tokens {offset}..{offset + length} outside sequence {i} of {size}")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return self._bin[start : start + length * self.dtype.itemsize].view(self.dtype)

    def document(self, d: int) -> np.ndarray:
        """All tokens of document ``d`` (its sequences concatenated; a view when it has one)."""
        n = self.num_documents
        if not -n <= d < n:
            raise IndexedDatasetError(f"{self.idx_file}: document index {d} out of range (0..{n - 1})")
        d %= n
        lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if hi - lo == 1:
            return self.get(lo)
        if hi == lo:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.sequence_pointers[lo])
        stop = int(self.sequence_pointers[hi - 1]) + int(self.sequence_lengths[hi - 1]) * self.dtype.itemsize
        return self._bin[start:stop].view(self.dtype)

    def document_lengths(self) -> np.ndarray:
        """Tokens per document (int64)."""
        cum = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=cum[1:])
        return np.diff(cum[self.document_indices])


class IndexedDatasetWriter:
    """Write ``PREFIX.bin``/``PREFIX.idx``; the files appear complete or not at all.

    Both files are written under temporary names and renamed by :meth:`finalize` (the ``.bin`` first),
    so a reader never sees a half-written index. Use as a context manager, or call
    :meth:`finalize`; leaving the ``with`` block on an exception removes the temporary files.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: Any = np.int32, *, multimodal: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise IndexedDatasetError(f"{self.prefix}: dtype {self.dtype} has no Megatron code")
        self._bin_tmp = Path(f"{bin_path(prefix)}.tmp{os.getpid()}")
        self._idx_tmp = Path(f"{idx_path(prefix)}.tmp{os.getpid()}")
        self._bin_tmp.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self._bin_tmp, "wb")  # noqa: SIM115 (closed by finalize/abort)
        self._lengths: list[int] = []
        self._doc_idx: list[int] = [0]
        self._modes: list[int] | None = [] if multimodal else None
        self._done = False

    def _write_tokens(self, tokens: Any) -> int:
        arr = np.asarray(tokens)
        out = arr.astype(self.dtype, copy=False)
        if arr.size and np.issubdtype(arr.dtype, np.integer) and not np.array_equal(out, arr):
            raise IndexedDatasetError(f"{self.prefix}: tokens do not fit {self.dtype.name}")
        self._fh.write(np.ascontiguousarray(out, dtype=self.dtype.newbyteorder("<")).tobytes())
        return int(out.size)

    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Append one sequence (call :meth:`end_document` after the last sequence of a document)."""
        self._lengths.append(self._write_tokens(tokens))
        if self._modes is not None:
            self._modes.append(int(mode))

    def end_document(self) -> None:
        """Close the current document."""
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens: Any, lengths: Iterable[int] | None = None, modes: Iterable[int] | None = None) -> None:
        """Append one document; ``lengths`` splits it into several sequences (default: one)."""
        n = self._write_tokens(tokens)
        lens = [n] if lengths is None else [int(x) for x in lengths]
        if sum(lens) != n:
            raise IndexedDatasetError(f"{self.prefix}: sequence lengths {lens} do not sum to the {n} tokens given")
        self._lengths.extend(lens)
        if self._modes is not None:
            self._modes.extend([0] * len(lens) if modes is None else [int(m) for m in modes])
        self._doc_idx.append(len(self._lengths))

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self._done:
            return
        self._fh.close()
        lengths = np.asarray(self._lengths, dtype="<i4")
        pointers = np.zeros(lengths.size, dtype="<i8")
        if lengths.size:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.asarray(self._doc_idx, dtype="<i8")
        with open(self._idx_tmp, "wb") as fh:
            fh.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], lengths.size, docs.size))
            fh.write(lengths.tobytes())
            fh.write(pointers.tobytes())
            fh.write(docs.tobytes())
            if self._modes is not None:
                fh.write(np.asarray(self._modes, dtype=np.int8).tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Discard what was written."""
        self._fh.close()
        for f in (self._bin_tmp, self._idx_tmp):
            f.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_indexed_dataset(prefix: str | os.PathLike[str], documents: Iterable[Any], dtype: Any = np.int32) -> None:
    """Write each document (an id array) as one sequence of one document."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)
