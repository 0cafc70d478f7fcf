"""A frozen stage's dataset list with sizes, counts and checksums (SPEC.md 4.1, report 3.4).

A manifest is a JSON file::

    {"format": "apertus-dataset-manifest", "version": 1,
     "datasets": [{"prefix": ..., "bin_bytes": ..., "idx_bytes": ..., "dtype": ...,
                   "sequences": ..., "documents": ..., "tokens": ...,
                   "bin_sha256": ..., "idx_sha256": ..., "metadata": {...} (optional)}, ...]}

:func:`write_manifest` writes it atomically (temporary file + rename); :func:`verify_manifest`
checks a list of prefixes against it before a run starts and raises :class:`ManifestError` listing
every prefix that is missing, extra or changed, and what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from apertus_plugins.infra.files import read_json, write_text_atomic

from .indexed import IndexedDataset, IndexedDatasetError, bin_path, idx_path

__all__ = ["ManifestError", "FORMAT", "describe_dataset", "manifest_document", "write_manifest", "read_manifest",
           "verify_manifest"]

FORMAT = "apertus-dataset-manifest"
_VERSION = 1
_BLOCK = 1 << 22


class ManifestError(ValueError):
    """A dataset list that does not match its manifest, or an unreadable manifest."""


def _sha256(path: Path, bar: Any = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            h.update(block)
            if bar is not None:
                bar.update(len(block))
    return h.hexdigest()


def _bar(prefixes: Sequence[str], checksums: bool, progress: bool, what: str) -> Any:
    """A tqdm bar over the bytes to hash (with checksums) or the prefixes to read; disabled unless ``progress``."""
    from tqdm import tqdm

    if checksums:
        total = sum(f.stat().st_size for p in prefixes for f in (bin_path(p), idx_path(p)) if f.is_file())
        return tqdm(total=total, desc=what, unit="B", unit_scale=True, disable=not progress)
    return tqdm(total=len(prefixes), desc=what, unit="dataset", disable=not progress)


def describe_dataset(prefix: str | os.PathLike[str], *, checksums: bool = True, bar: Any = None) -> dict[str, Any]:
    """The manifest entry of one ``PREFIX.bin``/``PREFIX.idx`` pair (raises if it is unreadable).

    ``bar`` (a tqdm bar) advances by the bytes hashed, or by one without checksums."""
    ds = IndexedDataset(prefix)
    entry: dict[str, Any] = {
        "prefix": os.fspath(prefix),
        "bin_bytes": bin_path(prefix).stat().st_size,
        "idx_bytes": idx_path(prefix).stat().st_size,
        "dtype": ds.dtype.name,
        "sequences": len(ds),
        "documents": ds.num_documents,
        "tokens": ds.num_tokens,
    }
    if checksums:
        entry["bin_sha256"] = _sha256(bin_path(prefix), bar)
        entry["idx_sha256"] = _sha256(idx_path(prefix), bar)
    elif bar is not None:
        bar.update(1)
    return entry


def manifest_document(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The manifest of datasets already described by :func:`describe_dataset` (each may carry ``metadata``).

    For datasets described where they were written (a parallel job's tasks); :func:`write_manifest`
    describes and writes in one go.
    """
    prefixes = [e["prefix"] for e in entries]
    dupes = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if dupes:
        raise ManifestError(f"prefixes listed twice: {', '.join(dupes)}")
    return {"format": FORMAT, "version": _VERSION, "datasets": [dict(e) for e in entries]}


def write_manifest(
    prefixes: Iterable[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    metadata: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """Describe every prefix and write the manifest to ``out`` atomically; returns the manifest.

    ``progress`` shows a tqdm bar over the bytes hashed.

    ``metadata`` maps a prefix to JSON-ready facts about how it was made (for example the image
    layout its sequences use); they are stored in the entry under ``"metadata"`` and are not
    checked by :func:`verify_manifest`.
    """
    prefixes = [os.fspath(p) for p in prefixes]
    metadata = {os.fspath(k): dict(v) for k, v in (metadata or {}).items()}
    unknown = sorted(set(metadata) - set(prefixes))
    if unknown:
        raise ManifestError(f"metadata given for prefixes not in the list: {', '.join(unknown)}")
    dupes = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if dupes:
        raise ManifestError(f"prefixes listed twice: {', '.join(dupes)}")
    entries = []
    with _bar([p for p in prefixes if bin_path(p).is_file()], True, progress, "hashing") as bar:
        for p in prefixes:
            try:
                entry = describe_dataset(p, bar=bar)
            except IndexedDatasetError as exc:
                raise ManifestError(f"{p}: {exc}") from exc
            if p in metadata:
                entry["metadata"] = metadata[p]
            entries.append(entry)
    manifest = manifest_document(entries)
    write_text_atomic(out, json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check the structure of a manifest file."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"{path}: no such manifest")
    data = read_json(path, ManifestError)
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("datasets"), list):
        raise ManifestError(f"{path}: not an {FORMAT} file")
    if data.get("version") != _VERSION:
        raise ManifestError(f"{path}: unsupported manifest version {data.get('version')!r}")
    return data


def verify_manifest(
    path: str | os.PathLike[str],
    prefixes: Sequence[str | os.PathLike[str]] | None = None,
    *,
    checksums: bool = True,
    progress: bool = False,
) -> dict[str, Any]:
    """Check datasets against a manifest; raise :class:`ManifestError` naming each problem.

    Args:
        path: the manifest file.
        prefixes: the stage's dataset list; it must name exactly the manifest's prefixes (in any
            order). ``None`` checks the manifest's own list.
        checksums: also recompute the sha256 of each file (sizes and counts are always checked).
        progress: show a tqdm bar (bytes hashed, or datasets read without checksums).

    Returns the manifest when every dataset matches.
    """
    manifest = read_manifest(path)
    listed = {e.get("prefix"): e for e in manifest["datasets"]}
    wanted = list(listed) if prefixes is None else [os.fspath(p) for p in prefixes]
    problems: list[str] = []
    for p in wanted:
        if p not in listed:
            problems.append(f"{p}: not in the manifest")
    for p in listed:
        if p not in wanted:
            problems.append(f"{p}: in the manifest but missing from the dataset list")
    present = [p for p in wanted if p in listed and bin_path(p).is_file() and idx_path(p).is_file()]
    with _bar(present, checksums, progress, "verifying") as bar:
        for p in wanted:
            want = listed.get(p)
            if want is None:
                continue
            missing = [str(f) for f in (bin_path(p), idx_path(p)) if not f.is_file()]
            if missing:
                problems.append(f"{p}: missing file(s) {', '.join(missing)}")
                continue
            try:
                got = describe_dataset(p, checksums=checksums, bar=bar)
            except IndexedDatasetError as exc:
                problems.append(f"{p}: unreadable ({exc})")
                continue
            for key, value in got.items():
                if key == "prefix":
                    continue
                if key in want and want[key] != value:
                    problems.append(f"{p}: {key} is {value!r}, the manifest says {want[key]!r}")
    if problems:
        raise ManifestError(f"{path}: the datasets do not match the manifest:\n  " + "\n  ".join(problems))
    return manifest
