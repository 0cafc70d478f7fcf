"""Where the pipeline reads and writes: local paths, ``file://`` URLs and every protocol fsspec has.

Inputs (media files, folders, WebDataset shards, JSONL), the work directory and the outputs are
named by a local path or a URL. Local paths (and ``file://`` URLs) go straight to the operating
system, as before; anything else (``s3://``, ``gs://``, ``hf://``, ``memory://``...) goes through
the fsspec filesystem registered for its protocol (:func:`fsspec.core.url_to_fs`), so a run on a
Ray cluster needs no shared POSIX filesystem: planning tasks read their shard's bytes, workers
write their shards and records, and the merge reads them back, all through fsspec.

Writes are atomic: a local file is written under a temporary name in its folder, flushed to disk
and renamed; a remote file is uploaded whole (an object store's PUT is atomic). Megatron's indexed
datasets are written by megatron-core's builder to a local file; :func:`local_copy` and
:func:`upload` carry them to and from a remote location.

``memory://`` is a filesystem inside one process: use it with ``--workers 0``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["is_local", "is_url", "local_path", "canonical", "join", "parent", "name_of", "exists", "isfile", "isdir",
           "size", "stamp", "open_read", "read_bytes", "write_bytes", "read_json", "write_json", "makedirs", "remove",
           "listdir", "walk_files", "local_copy", "upload", "protocol", "normalize", "AtomicWriter"]


def is_url(url: str) -> bool:
    return "://" in url


def _local_protocol(url: str) -> bool:
    return url.startswith(("file://", "local://"))


def is_local(url: str) -> bool:
    """Whether ``url`` is a path of this machine's filesystem (a plain path or a ``file://`` URL)."""
    return not is_url(url) or _local_protocol(url)


def local_path(url: str) -> str:
    """The operating-system path of a local ``url`` (``file:///a/b`` -> ``/a/b``)."""
    if _local_protocol(url):
        return url.split("://", 1)[1] or "/"
    return url


def protocol(url: str) -> str:
    return url.split("://", 1)[0] if is_url(url) and not _local_protocol(url) else "file"


def _fs(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of a remote ``url`` and the path it knows the object by."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{url}: no fsspec filesystem for protocol {protocol(url)!r} ({exc}); install the package "
                         "that provides it (s3fs, gcsfs, huggingface_hub...)") from exc
    return fs, path


def canonical(url: str) -> str:
    """The name a run records for an input or output: an absolute local path, or a normalized URL."""
    if is_local(url):
        return os.path.abspath(local_path(url))
    fs, path = _fs(url)
    return fs.unstrip_protocol(path)


def join(base: str, *parts: str) -> str:
    if is_local(base):
        return os.path.join(local_path(base), *parts)
    return posixpath.join(base, *parts)


def parent(url: str) -> str:
    if is_local(url):
        return os.path.dirname(local_path(url))
    head, sep, path = url.partition("://")
    return f"{head}{sep}{posixpath.dirname(path)}"


def name_of(url: str) -> str:
    return posixpath.basename(url.rstrip("/")) if is_url(url) else os.path.basename(url)


def normalize(url: str) -> str:
    """``os.path.normpath`` for local paths; the path part of a URL normalized the same way."""
    if is_local(url):
        return os.path.normpath(local_path(url))
    head, _sep, path = url.partition("://")
    lead = "/" if path.startswith("/") else ""
    return f"{head}://{lead}{posixpath.normpath(path).lstrip('/')}" if path else url


# ---------------------------------------------------------------------- queries
def exists(url: str) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = _fs(url)
    return bool(fs.exists(path))


def isfile(url: str) -> bool:
    if is_local(url):
        return os.path.isfile(local_path(url))
    fs, path = _fs(url)
    return bool(fs.isfile(path))


def isdir(url: str) -> bool:
    if is_local(url):
        return os.path.isdir(local_path(url))
    fs, path = _fs(url)
    return bool(fs.isdir(path))


def size(url: str) -> int:
    if is_local(url):
        return os.path.getsize(local_path(url))
    fs, path = _fs(url)
    return int(fs.info(path)["size"])


_STAMP_KEYS = ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag", "md5Hash", "created")


def _stamp_of(info: dict[str, Any]) -> Any:
    """What changes when a remote object is rewritten: its modification time, ETag or creation time."""
    for key in _STAMP_KEYS:
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        return value if isinstance(value, int | float) else str(value)
    return None


def stamp(url: str) -> list[Any]:
    """``[size, stamp]`` of a file (``[-1, -1]`` when it is missing); the stamp is ``st_mtime_ns`` locally."""
    if is_local(url):
        try:
            st = os.stat(local_path(url))
        except FileNotFoundError:
            return [-1, -1]
        return [st.st_size, st.st_mtime_ns]
    fs, path = _fs(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return [-1, -1]
    return [int(info.get("size") or 0), _stamp_of(info)]


# ---------------------------------------------------------------------- bytes
def open_read(url: str) -> Any:
    """A seekable binary file object (close it after use); ``FileNotFoundError`` when missing."""
    if is_local(url):
        return open(local_path(url), "rb")  # noqa: SIM115 (returned to the caller)
    fs, path = _fs(url)
    if not fs.isfile(path):
        raise FileNotFoundError(f"{url}: no such file")
    return fs.open(path, "rb")


def read_bytes(url: str, offset: int = 0, length: int | None = None) -> bytes:
    with open_read(url) as fh:
        if offset:
            fh.seek(offset)
        return fh.read() if length is None else fh.read(length)


def makedirs(url: str) -> None:
    if is_local(url):
        os.makedirs(local_path(url), exist_ok=True)
    else:
        fs, path = _fs(url)
        fs.makedirs(path, exist_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` atomically: a local temporary file, fsync and rename, or one upload."""
    if not is_local(url):
        fs, path = _fs(url)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)
        return
    path = local_path(url)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(url: str, data: Any, indent: int | None = None) -> None:
    text = json.dumps(data, ensure_ascii=False, indent=indent, separators=None if indent else (",", ":"))
    write_bytes(url, (text + ("\n" if indent else "")).encode("utf-8"))


def read_json(url: str) -> Any:
    return json.loads(read_bytes(url).decode("utf-8"))


def remove(url: str, recursive: bool = False) -> None:
    """Delete a file (or a folder with ``recursive``); a missing one is fine."""
    if is_local(url):
        path = local_path(url)
        if recursive and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return
    fs, path = _fs(url)
    with contextlib.suppress(FileNotFoundError):
        if fs.exists(path):
            fs.rm(path, recursive=recursive)


def listdir(url: str) -> list[str]:
    """Names (not paths) in a folder; empty when it does not exist."""
    if is_local(url):
        try:
            return sorted(os.listdir(local_path(url)))
        except FileNotFoundError:
            return []
    fs, path = _fs(url)
    if not fs.isdir(path):
        return []
    return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))


# ---------------------------------------------------------------------- folders
def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _walk_local(root: str, rel: str = "") -> Iterator[tuple[str, str, list[Any], frozenset[str]]]:
    """Files under ``root`` in the order of their relative paths, one folder's listing in memory at a time.

    A folder's entries are sorted with a folder named ``d`` keyed ``d/``: this visits files in
    exactly the order of sorting every relative path at once (a folder's files sort together).
    Hidden names are skipped; symbolic links to folders are listed by ``os.walk`` as folders and
    not entered, and so are they here.
    """
    here = os.path.join(root, rel) if rel else root
    entries = []
    with os.scandir(here) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            is_dir = e.is_dir()
            if is_dir and e.is_symlink():
                continue
            entries.append((e.name + "/" if is_dir else e.name, e.name, is_dir))
    entries.sort()
    names = frozenset(name for _k, name, is_dir in entries if not is_dir)
    for _key, name, is_dir in entries:
        sub = f"{rel}/{name}" if rel else name
        if is_dir:
            yield from _walk_local(root, sub)
        else:
            path = os.path.join(here, name)
            yield path, sub, stamp(path), names


def walk_files(source: str) -> Iterator[tuple[str, str, list[Any], frozenset[str] | None]]:
    """``(path or URL, path relative to the source, [size, stamp], names beside it)`` of every file of a source.

    Files come sorted by relative path; ``names`` holds the (non-hidden) file names of the same
    folder, ``None`` for a source that is a single file. A missing source raises ``FileNotFoundError``.
    """
    if is_local(source):
        root = local_path(source)
        if os.path.isfile(root):
            yield root, "", stamp(root), None
            return
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{source}: no such file or folder")
        yield from _walk_local(root)
        return
    fs, path = _fs(source)
    if fs.isfile(path):
        info = fs.info(path)
        yield fs.unstrip_protocol(path), "", [int(info.get("size") or 0), _stamp_of(info)], None
        return
    if not fs.isdir(path):
        raise FileNotFoundError(f"{source}: no such file or folder")
    base = path.rstrip("/")
    found = []
    for p, info in fs.find(base, detail=True).items():
        rel = p[len(base):].lstrip("/")
        if info.get("type", "file") == "file" and rel and not _hidden(rel):
            found.append((rel, p, [int(info.get("size") or 0), _stamp_of(info)]))
    found.sort()
    folders: dict[str, set[str]] = {}
    for rel, _p, _st in found:
        folders.setdefault(posixpath.dirname(rel), set()).add(posixpath.basename(rel))
    frozen = {k: frozenset(v) for k, v in folders.items()}
    for rel, p, st in found:
        yield fs.unstrip_protocol(p), rel, st, frozen[posixpath.dirname(rel)]


# ---------------------------------------------------------------------- datasets between here and there
@contextlib.contextmanager
def local_copy(urls: list[str]) -> Iterator[list[str]]:
    """Local paths of ``urls``: the paths themselves when local, else downloads (removed afterwards).

    Downloads keep their file names, in one folder per source folder (``P.bin`` and ``P.idx`` stay a pair).
    """
    if all(is_local(u) for u in urls):
        yield [local_path(u) for u in urls]
        return
    tmp = tempfile.mkdtemp(prefix="apertus-tokenize-")
    folders: dict[str, str] = {}
    try:
        out = []
        for u in urls:
            if is_local(u):
                out.append(local_path(u))
                continue
            folder = folders.setdefault(parent(u), os.path.join(tmp, str(len(folders))))
            os.makedirs(folder, exist_ok=True)
            dest = os.path.join(folder, name_of(u))
            fs, path = _fs(u)
            fs.get_file(path, dest)
            out.append(dest)
        yield out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def upload(local: str, url: str) -> None:
    """Put a finished local file at ``url`` (a rename when both are local)."""
    if is_local(url):
        os.replace(local, local_path(url))
        return
    fs, path = _fs(url)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.put_file(local, path)
    os.unlink(local)



class AtomicWriter:
    """A binary file that appears at ``url`` complete or not at all (a local temporary file until :meth:`commit`).

    Use as a context manager: leaving the block normally commits, an exception discards.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        if is_local(url):
            path = local_path(url)
            folder = os.path.dirname(path) or "."
            os.makedirs(folder, exist_ok=True)
        else:
            folder = None
        fd, self._tmp = tempfile.mkstemp(prefix=f".{name_of(url)}.", suffix=".tmp", dir=folder)
        self.fh = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> int:
        return self.fh.write(data)

    def tell(self) -> int:
        return self.fh.tell()

    def commit(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        if is_local(self.url):
            os.chmod(self._tmp, 0o666 & ~_umask())
        upload(self._tmp, self.url)

    def discard(self) -> None:
        self.fh.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()
