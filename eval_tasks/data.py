"""Local data for the evaluation tasks: one setting per dataset, a clear error when it is wrong.

Every task whose data lives on a hub also reads a local copy. The copy of dataset ``KEY`` is
found through the environment (this works the same for lm-eval, lmms-eval and the Python API):

- ``APERTUS_EVAL_DATA_<KEY>`` (``KEY`` upper-cased): the folder (or file) of that dataset; or
- ``APERTUS_EVAL_DATA``: a folder holding one sub-folder per dataset, named ``KEY`` (lower case).

A path set for the dataset that does not exist is an error naming the task and the setting (a
dataset missing from the ``APERTUS_EVAL_DATA`` folder comes from its hub); so is an unset path
for a dataset that cannot be downloaded (gated or unpublished: SwitzerlandQA, the charter prompts,
BFCL's JSON files). Without a setting the other tasks load their hub dataset as upstream does.

Layouts read (the hub's own layouts, so a ``git clone`` or ``snapshot_download`` of the dataset
repository works as is): ``[CONFIG/]SPLIT.{parquet,jsonl,json,csv}``, ``[CONFIG/]SPLIT-*.parquet``,
``[CONFIG/]data/SPLIT-*.parquet``, or a ``datasets.save_to_disk`` folder (of a ``DatasetDict``,
or of a ``Dataset`` when one split is asked for). In JSON and CSV files, media columns may hold
paths relative to the file; they are made absolute.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DataPathError", "ROOT_SETTING", "setting_name", "local_path", "load_split", "load_splits"]

ROOT_SETTING = "APERTUS_EVAL_DATA"
_EXTS = ("parquet", "jsonl", "json", "csv")


class DataPathError(FileNotFoundError):
    """The local data of a task is missing or unreadable; the message names the task and the setting."""


def setting_name(key: str) -> str:
    """The environment variable that points at dataset ``key``'s local copy."""
    return f"{ROOT_SETTING}_{key.upper()}"


def local_path(task: str, key: str, required: bool, why: str = "") -> tuple[Path, str] | None:
    """``(path, setting)`` of dataset ``key``'s local copy, or None when none is set and it is optional."""
    var = setting_name(key)
    value = os.environ.get(var, "").strip()
    if value:
        path, source = Path(value).expanduser(), var
    elif os.environ.get(ROOT_SETTING, "").strip():
        path = Path(os.environ[ROOT_SETTING].strip()).expanduser() / key.lower()
        source = f"{ROOT_SETTING} (sub-folder {key.lower()}/)"
        if not path.exists() and not required:  # the root holds some datasets; this one comes from its hub
            return None
    else:
        if required:
            raise DataPathError(
                f"task {task}: no local data for dataset {key!r}; set {var} to its folder "
                f"(or {ROOT_SETTING} to a folder with a {key.lower()}/ sub-folder)" + (f": {why}" if why else ""))
        return None
    if not path.exists():
        raise DataPathError(f"task {task}: the data path {path} given by {source} does not exist")
    return path, source


def _candidates(folder: Path, split: str) -> list[Path]:
    found: list[Path] = []
    for ext in _EXTS:
        if (folder / f"{split}.{ext}").is_file():
            found.append(folder / f"{split}.{ext}")
    if not found:
        for sub in (folder, folder / "data"):
            found = sorted(sub.glob(f"{split}-*.parquet")) + sorted(sub.glob(f"{split}_*.parquet"))
            if found:
                break
    return found


def _absolute_media(ds: Any, base: Path, media_columns: Sequence[str]) -> Any:
    cols = [c for c in media_columns if c in ds.column_names]
    if not cols:
        return ds

    def fix(row: dict[str, Any]) -> dict[str, Any]:
        for c in cols:
            v = row[c]
            if isinstance(v, str) and v and not v.startswith(("http://", "https://", "data:")) and not os.path.isabs(v):
                row[c] = str(base / v)
        return row

    return ds.map(fix)


def _read_files(files: list[Path], media_columns: Sequence[str]) -> Any:
    import datasets

    ext = files[0].suffix.lstrip(".")
    builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}[ext]
    ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    if builder in ("json", "csv"):
        ds = _absolute_media(ds, files[0].parent, media_columns)
    return ds


def load_split(task: str, key: str, split: str, *, config: str | None = None, hub: str | None = None,
               hub_config: str | None = None, media_columns: Sequence[str] = ("image", "audio"),
               why: str = "") -> Any:
    """One split of dataset ``key`` as a ``datasets.Dataset``: the local copy, else the hub's.

    ``hub`` (a hub dataset id) makes the local copy optional; ``config`` is the hub configuration
    (a sub-folder of the local copy when it has one).
    """
    import datasets

    where = local_path(task, key, required=hub is None, why=why)
    if where is None:
        return datasets.load_dataset(hub, hub_config or config, split=split)
    path, source = where
    try:
        if path.is_file():
            return _read_files([path], media_columns)
        folders = [path / config, path] if config and (path / config).is_dir() else [path]
        for folder in folders:
            if (folder / "dataset_dict.json").is_file():
                dd = datasets.load_from_disk(str(folder))
                if split not in dd:
                    raise DataPathError(f"task {task}: {folder} (from {source}) has splits {sorted(dd)}, "
                                        f"not {split!r}")
                return dd[split]
            if (folder / "dataset_info.json").is_file() and (folder / "state.json").is_file():
                return datasets.load_from_disk(str(folder))
            files = _candidates(folder, split)
            if files:
                return _read_files(files, media_columns)
    except DataPathError:
        raise
    except Exception as exc:  # a corrupt file: say which task and setting, keep the cause
        raise DataPathError(f"task {task}: cannot read the data under {path} (from {source}): {exc}") from exc
    looked = ", ".join(f"{split}.{e}" for e in _EXTS)
    raise DataPathError(f"task {task}: no data for split {split!r} under {path} (from {source}); "
                        f"looked for {looked}, {split}-*.parquet or a save_to_disk folder"
                        + (f" in {config}/" if config else ""))


def load_splits(task: str, key: str, splits: Sequence[str], **kwargs: Any) -> Any:
    """Several splits as a ``datasets.DatasetDict`` (what lm-eval's ``custom_dataset`` returns)."""
    import datasets

    return datasets.DatasetDict({s: load_split(task, key, s, **kwargs) for s in splits})
