"""Hugging Face Hub ids wherever the package takes a checkpoint or tokenizer directory.

Every command and loader that reads a checkpoint or a tokenizer (``apertus doctor``, ``encode``,
``tokenize --checkpoint/--tokenizer``, ``convert to-megatron``, ``merge-text-weights``,
:func:`apertus_plugins.encoders.load_media_tokenizers`) passes what it was given through
:func:`local_path`: a local directory is used as it is; anything else is read as a Hub model id,
``ORG/NAME`` or ``ORG/NAME@REVISION`` (a branch, tag or commit), and resolved through
``huggingface_hub`` into the Hugging Face cache (``$HF_HUB_CACHE``, default
``~/.cache/huggingface/hub``: the cache ``vllm serve`` and ``transformers`` use, so a model served
once is not fetched twice). ``HF_HUB_OFFLINE=1`` reads only that cache.

Only what a caller needs is fetched (``allow_patterns``): the small files (configs, tokenizer,
chat templates, the safetensors index: :data:`METADATA_PATTERNS`) always; the weights in full, or
only the shards that hold given tensor prefixes, read off ``model.safetensors.index.json`` first
(the media encoders need the shards with ``model.vision_tokenizer.*`` and ``model.audio_tokenizer.*``,
not the language model's). A resolved snapshot missing a needed file (a partial cache read
offline) is an error naming the id and the files, never a silently partial checkpoint.

:func:`add_to_cache` writes a local checkpoint directory into a Hub cache exactly as
``huggingface_hub`` lays one out (``models--ORG--NAME/{blobs,refs,snapshots}``), for an air-gapped
node that receives a copied checkpoint: afterwards every tool finds it by its id offline.

The released models have two spellings (:mod:`apertus_plugins.infra.release_ids`: ``swiss-ai/``, the
repositories that hold the weights, and ``apertus-ai/``, the spelling of vLLM's pull request and of served
model names): an id of one that is not in the cache resolves to the other's cached snapshot when that one
is complete for what the caller needs, so a checkpoint fetched under one spelling is not downloaded again
under the other; one in neither is downloaded from the publishing organisation's repository.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from .release_ids import canonical, other_spellings

__all__ = [
    "METADATA_PATTERNS",
    "HubError",
    "add_to_cache",
    "cache_dir",
    "is_offline",
    "local_path",
    "parse_hub_id",
]

#: The small files of a checkpoint or tokenizer repository: configs, tokenizer, chat templates, the
#: safetensors index, processor files. Weights are fetched on top of these when asked for.
METADATA_PATTERNS: tuple[str, ...] = (
    "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py", "*.md", "additional_chat_templates/*",
)
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+$")


class HubError(ValueError):
    """A path that is neither a local directory nor a Hub model id that can be resolved."""


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir() -> Path:
    """The Hugging Face Hub cache ``huggingface_hub`` reads and writes, from the environment as it is now."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expanduser(os.path.expandvars(os.environ[var])))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"]))) / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "huggingface" / "hub"


def parse_hub_id(ref: str | os.PathLike[str]) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``ref`` has the form of a Hub model id (``ORG/NAME[@REVISION]``), else None.

    Paths that say they are paths (absolute, ``./``, ``../``, ``~``, no ``/`` or more than one) are
    never ids: a bare name is a local path, so a mistyped directory is not looked up on the Hub.
    """
    s = os.fspath(ref)
    if not s or s.startswith(("/", "./", "../", "~", ".")) or "\\" in s:
        return None
    repo, _, revision = s.partition("@")
    if "@" in s and not revision:
        return None
    if not _ID.fullmatch(repo) or "--" in repo or ".." in repo or repo.endswith(".git"):
        return None
    return repo, revision or None


def local_path(ref: str | os.PathLike[str], *, weights: bool | Sequence[str] = True,
               what: str = "checkpoint") -> Path:
    """A local directory for ``ref``: ``ref`` itself when it exists, else its Hub snapshot in the cache.

    Args:
        ref: a local path, or a Hub model id ``ORG/NAME`` / ``ORG/NAME@REVISION``.
        weights: ``True`` for every file of the repository, ``False`` for the small files only
            (:data:`METADATA_PATTERNS`: a tokenizer), or tensor-name prefixes: the small files and
            the safetensors shards holding tensors under those prefixes (read from the index).
        what: how the caller names the argument in errors (``"checkpoint"``, ``"--tokenizer"``...).

    Raises:
        HubError: ``ref`` is not a local path and not a Hub id; the id cannot be resolved (not in
            the cache while offline, not found, unreachable); the snapshot lacks a needed file.
    """
    p = Path(os.path.expanduser(os.fspath(ref)))
    if p.exists():
        return p
    parsed = parse_hub_id(ref)
    if parsed is None:
        raise HubError(f"{what} {os.fspath(ref)!r}: no such file or directory (and not a Hub model id ORG/NAME)")
    repo, revision = parsed
    if weights is True:
        return _snapshot(repo, revision, None, what, ref)
    if not weights:
        return _snapshot(repo, revision, list(METADATA_PATTERNS), what, ref)
    prefixes = tuple(weights)
    meta = _snapshot(repo, revision, list(METADATA_PATTERNS), what, ref)
    shards = _shards_for(meta, prefixes, repo, revision, what, ref)
    folder = _snapshot(repo, revision, [*METADATA_PATTERNS, *shards], what, ref)
    if not (folder / _INDEX).is_file() and not any(folder.glob("*.safetensors")):
        raise HubError(f"{what} {os.fspath(ref)!r}: the snapshot {folder} of {_where(repo, revision)} holds no "
                       f"safetensors weights ({_INDEX} or {_SINGLE})")
    return folder


def _where(repo: str, revision: str | None) -> str:
    return f"{repo}@{revision}" if revision else repo


def _cached(repo: str, revision: str | None, allow: list[str] | None) -> Path | None:
    """The cached snapshot of ``repo@revision`` holding what ``allow`` needs, or None (never the network)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=allow, cache_dir=str(cache_dir()),
                                        local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    try:
        return None if _missing(folder, allow) else folder
    except HubError:
        return None


def _snapshot(repo: str, revision: str | None, allow: list[str] | None, what: str, ref: object) -> Path:
    aliases = other_spellings(repo)
    if aliases and _cached(repo, revision, allow) is None:
        for alias in aliases:  # the same release, fetched under its other spelling: no second download
            folder = _cached(alias, revision, allow)
            if folder is not None:
                return folder
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # a dependency of tokenizers, so normally present
        raise HubError(f"{what} {os.fspath(ref)!r} is a Hub id, which needs huggingface_hub "
                       "(pip install huggingface_hub)") from exc
    offline = is_offline()
    cache = cache_dir()
    # a release id under its other spelling downloads from the repository that holds the weights
    fetch = repo if offline else canonical(repo)
    try:
        folder = Path(snapshot_download(fetch, revision=revision, allow_patterns=allow, cache_dir=str(cache),
                                        local_files_only=offline))
    except LocalEntryNotFoundError as exc:
        if offline:
            raise HubError(f"{what} {os.fspath(ref)!r}: not a local directory, and the Hub model "
                           f"{_where(repo, revision)} is not in the Hugging Face cache {cache} (HF_HUB_OFFLINE is "
                           f"set: only the cache is read{_also(aliases)}; fetch it once online, e.g. hf download {repo})") from exc
        raise HubError(f"{what} {os.fspath(ref)!r}: the Hub model {_where(fetch, revision)} could not be fetched "
                       f"and is not in the Hugging Face cache {cache} ({exc})") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise HubError(f"{what} {os.fspath(ref)!r}: the Hub model {_where(fetch, revision)} could not be "
                       f"resolved ({type(exc).__name__}: {exc})") from exc
    missing = _missing(folder, allow)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise HubError(f"{what} {os.fspath(ref)!r}: the snapshot {folder} of {_where(fetch, revision)} lacks "
                       f"{shown} (a partial download{'; HF_HUB_OFFLINE is set' if offline else ''})")
    return folder


def _also(aliases: tuple[str, ...]) -> str:
    return f", and {' nor '.join(aliases)} (its other spelling) is not there whole either" if aliases else ""


def _weight_files(folder: Path) -> list[str] | None:
    """The weight files a snapshot's index names (None when there is no index)."""
    index = folder / _INDEX
    if not index.is_file():
        return None
    try:
        return sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise HubError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc


def _missing(folder: Path, allow: list[str] | None) -> list[str]:
    """Files a resolved snapshot must hold for ``allow`` and does not."""
    files = _weight_files(folder)
    if files is None:
        return []
    wanted = files if allow is None else [f for f in files if any(fnmatch.fnmatch(f, a) for a in allow)]
    return [f for f in wanted if not (folder / f).is_file()]


def _shards_for(meta: Path, prefixes: tuple[str, ...], repo: str, revision: str | None, what: str,
                ref: object) -> list[str]:
    """The weight files holding tensors under ``prefixes`` (from the index; else the single file)."""
    index = meta / _INDEX
    if not index.is_file():
        return [_SINGLE, "*.safetensors"]
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
    shards = sorted({f for name, f in weight_map.items() if name.startswith(prefixes)})
    if not shards:
        raise HubError(f"{what} {os.fspath(ref)!r}: the index of {_where(repo, revision)} names no tensor under "
                       f"{', '.join(prefixes)}")
    return shards


# ---------------------------------------------------------------------- writing a cache
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".model", ".npz", ".h5", ".onnx", ".gguf")
_LFS_THRESHOLD = 10 * 1024 * 1024


def _etag(path: Path, data: bytes) -> str:
    """The blob name the Hub gives a file: the sha256 of an LFS file, the git blob sha1 of another."""
    if path.suffix in _LFS_SUFFIXES or len(data) >= _LFS_THRESHOLD:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's object name


def add_to_cache(directory: str | os.PathLike[str], repo_id: str, *, revision: str = "main",
                 cache: str | os.PathLike[str] | None = None, files: Iterable[str] | None = None) -> Path:
    """Write ``directory`` into a Hub cache as snapshot ``repo_id@revision``; returns the snapshot folder.

    The layout is ``huggingface_hub``'s: each file's content once under ``blobs/`` (named by its
    sha256 for LFS files, its git blob sha1 otherwise), ``snapshots/COMMIT/PATH`` as relative
    symlinks into ``blobs/``, and ``refs/REVISION`` holding the commit (a hash of the contents).
    ``files`` limits the copy to those relative paths (a partial cache, as ``allow_patterns``
    leaves one).
    """
    src = Path(directory)
    if not src.is_dir():
        raise HubError(f"{src}: not a directory")
    if parse_hub_id(repo_id) is None or "@" in repo_id:
        raise HubError(f"{repo_id!r}: not a Hub model id ORG/NAME")
    root = Path(cache) if cache is not None else cache_dir()
    store = root / ("models--" + repo_id.replace("/", "--"))
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    if files is not None:
        keep = set(files)
        unknown = sorted(keep - set(names))
        if unknown:
            raise HubError(f"{src}: no such files {unknown}")
        names = [n for n in names if n in keep]
    entries = []
    for name in names:
        data = (src / name).read_bytes()
        etag = _etag(src / name, data)
        blob = store / "blobs" / etag
        if not blob.is_file():
            blob.parent.mkdir(parents=True, exist_ok=True)
            tmp = blob.with_suffix(".incomplete")
            tmp.write_bytes(data)
            tmp.replace(blob)
        entries.append((name, etag))
    commit = hashlib.sha1("".join(f"{n}\0{e}\n" for n, e in entries).encode()).hexdigest()  # noqa: S324
    snap = store / "snapshots" / commit
    for name, etag in entries:
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        depth = len(Path(name).parts) - 1
        target = Path(*([".."] * (2 + depth)), "blobs", etag)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    (store / "refs").mkdir(parents=True, exist_ok=True)
    (store / "refs" / revision).write_text(commit)
    return snap
