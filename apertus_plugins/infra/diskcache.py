"""A bounded, content-addressed byte store on disk that several processes share.

:class:`DiskCache` keeps one file per key under ``DIR/v1/<first two hex digits>/<key>.bin``. It is
made for caches whose values are a pure function of their key (the media-code cache of
:mod:`apertus_plugins.encoders.cache`): two processes that write the same key write the same bytes,
so the last rename wins and nothing is lost.

- **Atomic**: an entry is written to a temporary file beside its place and renamed into place
  (``os.replace``), so a reader sees a whole entry or none; a crashed writer leaves only a
  ``.tmp-*`` file, removed by a later scan once it is an hour old.
- **Checked on read, against its key**: every entry starts with a header (magic, payload length,
  SHA-256 of the key it was written for, SHA-256 of the payload); an entry whose header, length or
  digests do not match (a truncated copy, a flipped bit, a foreign file, or a whole entry that sits
  under another key's name: a cache merged or restored by hand, a writer's bug) is removed and reported
  as a miss, never returned: a value is only ever served for the key it was computed for.
- **Private by default**: the directories the cache creates are ``0700`` (its user only). Whoever can
  write the cache decides the values its readers get, so a cache shared by several users is their
  choice, made by creating the directory with wider permissions first; the cache then says so once.
- **Bounded, least recently used**: a hit refreshes the entry's modification time; when the bytes
  on disk pass ``max_bytes`` the oldest entries are removed until 90% of the bound remains. Each
  process estimates the total from a directory scan plus its own writes and rescans when the
  estimate passes the bound (or every :data:`RESCAN_EVERY` writes, to see the others' writes);
  entries that another process removed first are skipped.
- **Never an error**: the cache is an optimisation; a write that fails (disk full, permissions)
  is logged once and dropped.

Only the standard library is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import tempfile
import time
from pathlib import Path

__all__ = ["DiskCache", "HEADER", "LAYOUT", "MAGIC", "RESCAN_EVERY"]

logger = logging.getLogger(__name__)

#: The first bytes of every entry (format version 2: the key's digest in the header).
MAGIC = b"APC2"
#: magic, payload length (little-endian uint64), SHA-256 of the key, SHA-256 of the payload.
HEADER = struct.Struct("<4sQ32s32s")
#: The subdirectory of this format's entries (a version-1 cache beside it is never read).
LAYOUT = "v2"
_PRIVATE = 0o700
#: Writes between two directory scans of one process (how soon it sees the others' writes).
RESCAN_EVERY = 256
_LOW_WATER = 0.9
_STALE_TMP_SECONDS = 3600.0
_KEY = re.compile(r"[0-9a-f]{16,128}")


class DiskCache:
    """Bytes by hexadecimal key, under ``directory``, at most about ``max_bytes`` on disk.

    Counters (this process only): ``hits``, ``misses``, ``stores``, ``corrupt`` (entries found
    damaged and removed), ``evicted`` (entries this process removed to stay within the bound).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"DiskCache: max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory).expanduser()
        self.max_bytes = int(max_bytes)
        self.root = self.directory / LAYOUT
        _private_dir(self.directory, parents=True)
        _private_dir(self.root)
        shared = _shared_by_others(self.directory)
        if shared:
            logger.warning("media cache: %s is writable by %s: whoever can write it decides the codes its readers "
                           "get (a shared cache is a choice; see the docs)", self.directory, shared)
        self.hits = self.misses = self.stores = self.corrupt = self.evicted = 0
        self._estimate: int | None = None
        self._writes_since_scan = 0
        self._write_failed = False

    def __repr__(self) -> str:
        return f"DiskCache({str(self.directory)!r}, max_bytes={self.max_bytes})"

    def path(self, key: str) -> Path:
        """Where ``key``'s entry lives (it may not exist)."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"DiskCache: a key is 16-128 lowercase hex digits, got {key!r}")
        return self.root / key[:2] / f"{key}.bin"

    # ------------------------------------------------------------------ read
    def get(self, key: str) -> bytes | None:
        """The payload stored under ``key``, or ``None`` (absent, or damaged and now removed)."""
        path = self.path(key)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            self.misses += 1
            return None
        payload = _unpack(data, key)
        if payload is None:
            logger.warning("media cache: %s is damaged or belongs to another key (%d bytes); removed, the value is "
                           "recomputed", path, len(data))
            self.corrupt += 1
            self.misses += 1
            _unlink(path)
            return None
        try:
            os.utime(path)  # least recently used: a hit makes the entry young again
        except OSError:
            pass  # removed meanwhile by another process's eviction: the payload read is whole
        self.hits += 1
        return payload

    # ------------------------------------------------------------------ write
    def put(self, key: str, payload: bytes) -> bool:
        """Store ``payload`` under ``key`` (atomically); ``False`` when it was not stored."""
        path = self.path(key)
        blob = HEADER.pack(MAGIC, len(payload), _key_digest(key), hashlib.sha256(payload).digest()) + bytes(payload)
        if len(blob) > self.max_bytes:
            return False
        tmp = None
        try:
            _private_dir(path.parent)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=f"-{os.getpid()}")
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, path)
        except OSError as exc:
            if tmp is not None:
                _unlink(Path(tmp))
            if not self._write_failed:
                logger.warning("media cache: cannot write under %s (%s); continuing without storing", self.root, exc)
                self._write_failed = True
            return False
        self.stores += 1
        self._account(len(blob))
        return True

    # ------------------------------------------------------------------ bound
    def size(self) -> int:
        """Bytes of all entries on disk now (a scan)."""
        return sum(size for _, size, _ in self._entries())

    def _account(self, written: int) -> None:
        if self._estimate is None:
            self._estimate = self.size()
        else:
            self._estimate += written
        self._writes_since_scan += 1
        if self._estimate > self.max_bytes or self._writes_since_scan >= RESCAN_EVERY:
            self.trim()

    def trim(self) -> int:
        """Rescan and remove the least recently used entries until the bound holds; returns bytes left."""
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        if total > self.max_bytes:
            target = int(self.max_bytes * _LOW_WATER)
            for path, size, _ in sorted(entries, key=lambda e: e[2]):
                if total <= target:
                    break
                if _unlink(path):
                    self.evicted += 1
                total -= size  # removed by us or, first, by another process: gone either way
        self._estimate = total
        self._writes_since_scan = 0
        return total

    def _entries(self) -> list[tuple[Path, int, float]]:
        out: list[tuple[Path, int, float]] = []
        now = time.time()
        try:
            subdirs = [d for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
        except OSError:
            return out
        for sub in subdirs:
            try:
                files = list(os.scandir(sub.path))
            except OSError:
                continue
            for f in files:
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if f.name.startswith(".tmp-"):
                    if now - st.st_mtime > _STALE_TMP_SECONDS:
                        _unlink(Path(f.path))  # a writer that died before its rename
                    continue
                if f.name.endswith(".bin"):
                    out.append((Path(f.path), st.st_size, st.st_mtime))
        return out

    def stats(self) -> dict[str, int]:
        """This process's counters."""
        return {"hits": self.hits, "misses": self.misses, "stores": self.stores, "corrupt": self.corrupt,
                "evicted": self.evicted}


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(b"apertus-diskcache-key\0" + key.encode("ascii")).digest()


def _unpack(data: bytes, key: str) -> bytes | None:
    """The payload of an entry written for ``key``; None for a damaged entry or another key's."""
    if len(data) < HEADER.size:
        return None
    magic, length, key_digest, digest = HEADER.unpack_from(data)
    payload = data[HEADER.size:]
    if magic != MAGIC or length != len(payload) or key_digest != _key_digest(key):
        return None
    if hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def _private_dir(path: Path, parents: bool = False) -> None:
    """Create ``path`` readable and writable by its user only; an existing directory keeps its mode."""
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=_PRIVATE)
    except FileExistsError:
        return
    os.chmod(path, _PRIVATE)  # mkdir's mode passes through the umask; the cache's own stays private


def _shared_by_others(path: Path) -> str:
    """``"its group"`` / ``"other users"`` when ``path`` is writable by them, else empty."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return ""
    if mode & 0o002:
        return "other users"
    if mode & 0o020:
        return "its group"
    return ""


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
