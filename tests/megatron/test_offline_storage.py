"""Inputs and outputs through fsspec, and the ``--merge parts`` output.

* fsspec's in-memory filesystem: the inputs (a media folder, a WebDataset shard, a JSONL file with
  media beside it) copied into ``memory://``, the output, its work directory and its report written
  there (``--workers 0``: that filesystem lives in one process); the bytes and manifest figures equal
  the local reference run's.
* fsspec's local filesystem by ``file://`` URLs, with local worker processes: the same bytes.
* ``--merge parts``: one dataset per plan part, merged in parallel; read in manifest order they hold
  exactly the reference's documents; each part's manifest entry checks out.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import fsspec
import numpy as np
import pytest
from _offline_data import SFT_SUFFIXES, cli, outputs, reference, workspace

from apertus_plugins.data.indexed import IndexedDataset
from apertus_plugins.data.manifest import verify_manifest
from apertus_plugins.data.offline import RunError, TokenizeConfig, tokenize


def _to_memory(fs: fsspec.AbstractFileSystem, local: Path, remote: str) -> None:
    for f in [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file()):
        rel = f.relative_to(local) if f != local else Path(f.name)
        fs.pipe_file(f"{remote}/{rel}" if f != local else remote, f.read_bytes())


def _memory_outputs(fs: fsspec.AbstractFileSystem, prefix: str, suffixes: tuple[str, ...]) -> dict[str, object]:
    got: dict[str, object] = {}
    for s in suffixes:
        for ext in (".bin", ".idx"):
            got[s + ext] = fs.cat_file(f"{prefix}{s}{ext}")
        if not s.endswith(".mask"):
            manifest = json.loads(fs.cat_file(f"{prefix}{s}.manifest.json"))
            got[s + ".manifest"] = [{k: v for k, v in e.items() if k != "prefix"} for e in manifest["datasets"]]
    return got


def test_memory_filesystem_inputs_and_outputs() -> None:
    ws = workspace()
    fs = fsspec.filesystem("memory")
    root = "/apertus-tokenize-test"
    _to_memory(fs, ws.folder, f"{root}/folder")
    _to_memory(fs, ws.shard, f"{root}/shard-000.tar")
    _to_memory(fs, ws.conversations, f"{root}/conv.jsonl")
    _to_memory(fs, ws.conversations.parent / "files", f"{root}/files")
    try:
        out = f"memory://{root}/out/pretrain"
        cfg = TokenizeConfig("pretrain", [f"memory://{root}/folder", f"memory://{root}/shard-000.tar"], out=out,
                             tokenizer=str(ws.tokenizer), checkpoint=str(ws.checkpoint), batch_size=4, workers=0,
                             progress=False, plan_files=5)
        report = tokenize(cfg, out=io.StringIO())
        assert _memory_outputs(fs, f"{root}/out/pretrain", ("",)) == outputs(reference("pretrain"))
        want = json.loads(Path(f"{reference('pretrain')}.report.json").read_text())
        assert report["items"] == want["items"] and report["tokens"] == want["tokens"]
        assert [(Path(s["source"]).name, s["reason"]) for s in report["skipped"]] == \
            [(Path(s["source"]).name, s["reason"]) for s in want["skipped"]]
        assert json.loads(fs.cat_file(f"{root}/out/pretrain.report.json")) == report
        assert not fs.exists(f"{root}/out/pretrain.work")  # removed after success
        assert any(s["source"].startswith(f"memory://{root}/folder/") for s in report["skipped"])

        out = f"memory://{root}/out/sft"
        cfg = TokenizeConfig("sft", [f"memory://{root}/conv.jsonl"], out=out, tokenizer=str(ws.tokenizer),
                             checkpoint=str(ws.checkpoint), batch_size=2, without_reasoning=True, mask_stream=True,
                             workers=0, progress=False, plan_bytes=4096, max_bad_fraction=1.0)
        report = tokenize(cfg, out=io.StringIO())
        assert _memory_outputs(fs, f"{root}/out/sft", SFT_SUFFIXES) == outputs(reference("sft"), SFT_SUFFIXES)
        assert report["run"]["shards"] > 1
        # a second run finds the output complete; a changed input is refused
        log = io.StringIO()
        assert tokenize(cfg, out=log) == report and "already complete" in log.getvalue()
        fs.pipe_file(f"{root}/files/cat.png", fs.cat_file(f"{root}/files/cat.png") + b"\0")
        with pytest.raises(RunError, match="changed"):
            tokenize(cfg, out=io.StringIO())
        cfg.workers = 2
        with pytest.raises(RunError, match="memory://.*--workers 0"):
            tokenize(cfg, out=io.StringIO())
    finally:
        fs.rm(root, recursive=True)


def test_file_urls_with_local_workers(tmp_path: Path) -> None:
    ws = workspace()
    out = tmp_path / "url" / "pretrain"
    args = ws.pretrain_args(out, "--workers", "2", "--plan-files", "3")
    args = [f"file://{a}" if a in (str(ws.folder), str(ws.shard), str(out)) else a for a in args]
    res = cli(args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert outputs(out) == outputs(reference("pretrain"))


def test_parts_hold_the_documents_in_order(tmp_path: Path) -> None:
    ws = workspace()
    out = tmp_path / "parts" / "sft"
    res = cli(ws.sft_args(out, "--workers", "0", "--merge", "parts", "--plan-bytes", "2KB"))
    assert res.returncode == 0, res.stdout + res.stderr
    ref = reference("sft")
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert not Path(f"{out}.bin").exists()
    for base in ("", ".noreason"):
        manifest = verify_manifest(f"{out}{base}.manifest.json")  # every part's sizes, counts and checksums
        listed = [e["prefix"] for e in manifest["datasets"]]
        parts = report["outputs"][f"{out}{base}"]["parts"]
        assert len(parts) > 1 and listed == [p for part in parts for p in (part, f"{part}.mask")]
        for suffix in ("", ".mask"):
            docs = [IndexedDataset(f"{p}{suffix}").document(d).tolist() for p in parts
                    for d in range(IndexedDataset(f"{p}{suffix}").num_documents)]
            want = IndexedDataset(f"{ref}{base}{suffix}")
            assert docs == [want.document(d).tolist() for d in range(want.num_documents)]
        assert all(e["metadata"]["reasoning"] == ("removed" if base else "kept") for e in manifest["datasets"])
    tokens = np.concatenate([IndexedDataset(p).document(d) for p in report["outputs"][str(out)]["parts"]
                             for d in range(IndexedDataset(p).num_documents)])
    assert report["tokens"]["total"] == tokens.size
    res = cli(ws.sft_args(out, "--workers", "0", "--merge", "parts", "--plan-bytes", "2KB"))
    assert res.returncode == 0 and "already complete" in res.stdout
