"""The persistent media-code cache: the byte store (infra.diskcache) and the code cache on top (encoders.cache)."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from apertus_plugins.encoders.cache import DEFAULT_SIZE, MediaCodeCache, default_directory, media_key
from apertus_plugins.infra.diskcache import HEADER, LAYOUT, DiskCache

rng = np.random.default_rng(3)


class Counting:
    """An encoder stand-in: codes are a pure function of the pixels; ``calls`` records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, items: list[np.ndarray]) -> list[np.ndarray]:
        self.calls.append(len(items))
        return [(np.asarray(x).reshape(3, -1).sum(axis=1) * 1000).astype(np.int64) for x in items]


def _cached(cache: MediaCodeCache, enc: Counting, items: list[np.ndarray], fingerprint: str = "w1") -> list:
    return cache.codes("image", None, items, lambda todo: enc([items[i] for i in todo]), variant="float32",
                       fingerprint=fingerprint)


def _pixels(h: int = 32, w: int = 32) -> np.ndarray:
    return rng.uniform(-1, 1, (3, h, w)).astype(np.float32)


# ---------------------------------------------------------------------------- switching it on
def test_off_unless_asked(tmp_path, monkeypatch):
    assert MediaCodeCache.from_env({}) is None
    for off in ("", "0", "off", "false"):
        assert MediaCodeCache.from_env({"APERTUS_MEDIA_CACHE": off}) is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    on = MediaCodeCache.from_env({"APERTUS_MEDIA_CACHE": "1"})
    assert on is not None and on.store.directory == tmp_path / "xdg" / "apertus-plugins" / "media-codes"
    assert default_directory() == on.store.directory and on.store.max_bytes == DEFAULT_SIZE
    there = MediaCodeCache.from_env({"APERTUS_MEDIA_CACHE": str(tmp_path / "c"), "APERTUS_MEDIA_CACHE_SIZE": "5MB"})
    assert there is not None and there.store.directory == tmp_path / "c" and there.store.max_bytes == 5 * 2**20
    # a flag wins over the environment, "0" as a flag turns it off
    env = {"APERTUS_MEDIA_CACHE": str(tmp_path / "c")}
    assert MediaCodeCache.resolve("0", None, env) is None
    assert MediaCodeCache.resolve(str(tmp_path / "d"), "1MB", env).store.max_bytes == 2**20  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="APERTUS_MEDIA_CACHE_SIZE"):
        MediaCodeCache.from_env({"APERTUS_MEDIA_CACHE": str(tmp_path / "c"), "APERTUS_MEDIA_CACHE_SIZE": "lots"})
    with pytest.raises(ValueError, match="positive"):
        MediaCodeCache.resolve(str(tmp_path / "c"), "0")


# ---------------------------------------------------------------------------- hits and misses
def test_second_lookup_encodes_nothing_and_returns_the_same_codes(tmp_path):
    items = [_pixels(), _pixels(), _pixels(16, 48)]
    enc = Counting()
    first = _cached(MediaCodeCache(tmp_path), enc, items)
    assert enc.calls == [3]
    again = MediaCodeCache(tmp_path)  # another process's view: only the disk is shared
    second = _cached(again, enc, items + [items[0]])
    assert enc.calls == [3]
    assert again.hits == 4 and again.misses == 0
    for a, b in zip(first + [first[0]], second, strict=True):
        assert b.dtype == np.int64 and np.array_equal(a, b)
    # one new item among stored ones: only it is encoded, repeats of it in one call once
    new = _pixels()
    third = _cached(again, enc, [items[1], new, new])
    assert enc.calls == [3, 1] and again.misses == 1 and again.hits == 6
    assert np.array_equal(third[1], third[2]) and np.array_equal(third[0], first[1])


def test_key_follows_weights_preprocessing_and_precision():
    x = _pixels()
    base = media_key("image", x, "w1", "float32")
    assert base == media_key("image", x.copy(), "w1", "float32")
    assert base != media_key("image", x, "w2", "float32")  # other weights
    assert base != media_key("image", x, "w1", "tf32")  # other precision
    assert base != media_key("audio", x, "w1", "float32")
    y = x.copy()
    y[0, 0, 0] = np.nextafter(y[0, 0, 0], np.float32(2))  # one ulp of one pixel
    assert base != media_key("image", y, "w1", "float32")
    assert base != media_key("image", x.reshape(3, 16, 64), "w1", "float32")  # same bytes, other shape
    assert base != media_key("image", x.astype(np.float64), "w1", "float32")


def test_other_weights_miss(tmp_path):
    cache, enc, items = MediaCodeCache(tmp_path), Counting(), [_pixels()]
    _cached(cache, enc, items, "w1")
    _cached(cache, enc, items, "w2")
    assert enc.calls == [1, 1]


# ---------------------------------------------------------------------------- damaged entries
@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign"])
def test_a_damaged_entry_is_removed_and_recomputed_never_served(tmp_path, damage):
    cache, enc, items = MediaCodeCache(tmp_path), Counting(), [_pixels()]
    want = _cached(cache, enc, items)[0]
    path = cache.store.path(media_key("image", items[0], "w1", "float32"))
    data = path.read_bytes()
    bad = {"flip": data[:-3] + bytes([data[-3] ^ 1]) + data[-2:], "truncate": data[: len(data) - 7],
           "empty": b"", "foreign": b"x" * len(data)}[damage]
    path.write_bytes(bad)
    fresh = MediaCodeCache(tmp_path)
    got = _cached(fresh, enc, items)[0]
    assert enc.calls == [1, 1] and fresh.misses == 1 and fresh.store.corrupt == 1
    assert np.array_equal(got, want)
    assert path.read_bytes() == data  # the recomputed entry replaced the damaged one
    assert fresh.store.get(path.stem) is not None


def test_the_header_names_length_and_digest(tmp_path):
    store = DiskCache(tmp_path, 2**20)
    store.put("ab" * 16, b"payload")
    raw = store.path("ab" * 16).read_bytes()
    assert raw[:4] == b"APC2" and len(raw) == HEADER.size + 7
    assert raw[HEADER.size:] == b"payload" and raw[12:44] == hashlib.sha256(b"apertus-diskcache-key\0" + b"ab" * 16
                                                                         ).digest()  # the key it was written for
    with pytest.raises(ValueError, match="hex"):
        store.path("../../etc/passwd")


@pytest.mark.parametrize("how", ["moved", "copied"])
def test_an_entry_under_another_keys_name_is_a_miss_and_recomputed(tmp_path, how):
    """A whole, well-formed entry renamed or copied to another key's place is never served as that item's codes."""
    cache, enc = MediaCodeCache(tmp_path), Counting()
    first, second = [_pixels()], [_pixels()]
    want_first, want_second = _cached(cache, enc, first)[0], _cached(cache, enc, second)[0]
    assert not np.array_equal(want_first, want_second)
    a = cache.store.path(media_key("image", first[0], "w1", "float32"))
    b = cache.store.path(media_key("image", second[0], "w1", "float32"))
    (os.replace if how == "moved" else shutil.copyfile)(a, b)  # first's entry now sits under second's key
    fresh = MediaCodeCache(tmp_path)
    calls = len(enc.calls)
    got = _cached(fresh, enc, second)[0]
    assert len(enc.calls) == calls + 1 and fresh.misses == 1 and fresh.store.corrupt == 1  # recomputed
    assert np.array_equal(got, want_second)  # its own codes, not the first item's
    assert fresh.store.get(b.stem) is not None  # the recomputed entry took its place
    assert (fresh.store.get(a.stem) is None) == (how == "moved")  # a copy left the first item's own entry whole
    # the same at the byte store: each key's digest is in its entry
    store = DiskCache(tmp_path / "raw", 2**20)
    store.put("aa" * 16, b"one")
    store.put("bb" * 16, b"two")
    os.replace(store.path("aa" * 16), store.path("bb" * 16))
    assert store.get("bb" * 16) is None and store.corrupt == 1 and not store.path("bb" * 16).exists()


def test_the_cache_directory_is_private_to_its_user_unless_made_shared(tmp_path, caplog):
    old = os.umask(0o022)
    try:
        store = DiskCache(tmp_path / "new" / "media", 2**20)
        store.put("ab" * 16, b"x")
    finally:
        os.umask(old)
    for d in (tmp_path / "new" / "media", store.root, store.path("ab" * 16).parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    shared = tmp_path / "team"
    shared.mkdir()
    os.chmod(shared, 0o775)  # a team's choice, made before the cache is opened: kept, and said
    with caplog.at_level(logging.WARNING, logger="apertus_plugins.infra.diskcache"):
        DiskCache(shared, 2**20)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o775
    assert any("is writable by its group: whoever can write it decides the codes" in r.getMessage()
               for r in caplog.records)


# ---------------------------------------------------------------------------- the bound
def test_eviction_keeps_the_bound_and_the_recently_used(tmp_path):
    store = DiskCache(tmp_path, 20_000)
    payload = bytes(1000)
    keys = [f"{i:032x}" for i in range(60)]
    base = time.time() - 10_000

    def put(i: int) -> None:  # explicit ages: the file system's clock may be coarser than the loop
        store.put(keys[i], payload)
        os.utime(store.path(keys[i]), (base + i, base + i))

    for i in range(10):
        put(i)
    assert store.get(keys[0]) == payload  # a hit makes the oldest entry the youngest (now)
    for i in range(10, 60):
        put(i)
        assert store.size() <= 20_000
    assert store.evicted > 0 and store.get(keys[0]) == payload
    assert store.get(keys[1]) is None and store.get(keys[59]) == payload  # the least recently used went first
    assert store.put("cd" * 16, bytes(30_000)) is False  # larger than the whole cache: not stored


# ---------------------------------------------------------------------------- several processes
def _writer(directory: str, worker: int, rounds: int, max_bytes: int) -> None:
    store = DiskCache(directory, max_bytes)
    for r in range(rounds):
        for k in range(8):  # shared keys: every worker writes the same bytes for them
            key = f"{k:032x}"
            store.put(key, key.encode() * 50)
            got = store.get(key)
            assert got is None or got == key.encode() * 50
        own = f"f{worker:015x}{r:016x}"  # never one of the shared keys
        store.put(own, own.encode() * (1 + r % 7) * 20)
        got = store.get(own)
        assert got is None or got == own.encode() * (1 + r % 7) * 20


def test_processes_writing_same_and_different_keys_at_once(tmp_path):
    ctx = mp.get_context("spawn")
    max_bytes = 60_000
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 60, max_bytes)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    store = DiskCache(tmp_path, max_bytes)
    files = [f for f in Path(tmp_path, LAYOUT).rglob("*") if f.is_file()]
    assert files and not [f for f in files if f.name.startswith(".tmp-")]
    for f in files:  # every entry left is whole
        key = f.stem
        payload = store.get(key)
        assert payload is not None, f
        assert payload.startswith(key.encode())
    assert store.corrupt == 0
    assert store.size() <= max_bytes + 4 * 8 * 2000  # each process may overshoot by what it wrote since its scan


def test_an_unusable_directory_is_named_at_start_and_a_failed_write_is_skipped(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot use .*file/codes"):
        MediaCodeCache.resolve(str(tmp_path / "file" / "codes"))
    cache = MediaCodeCache(tmp_path / "c")
    (cache.store.root / "ab").write_text("in the way")  # the entry's folder cannot be made
    enc = Counting()
    assert cache.store.put("ab" + "0" * 30, b"x") is False and cache.store.put("ab" + "1" * 30, b"y") is False
    assert caplog.text.count("cannot write") == 1  # logged once
    assert _cached(cache, enc, [_pixels()])[0].shape == (3,)  # encoding goes on without the store
