"""Dataset manifests and the `apertus manifest` / `apertus inspect` commands."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from apertus_plugins.cli import main
from apertus_plugins.core.goldfish import goldfish_drop
from apertus_plugins.core.targets import sft_mask
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.data.indexed import write_indexed_dataset
from apertus_plugins.data.manifest import ManifestError, read_manifest, verify_manifest, write_manifest
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer


@pytest.fixture
def datasets(tmp_path: Path) -> list[str]:
    rng = np.random.default_rng(0)
    prefixes = []
    for name in ("a", "b", "c"):
        docs = [rng.integers(0, 1000, int(rng.integers(1, 40))) for _ in range(int(rng.integers(1, 10)))]
        write_indexed_dataset(tmp_path / name, docs)
        prefixes.append(str(tmp_path / name))
    return prefixes


def test_write_and_verify(datasets: list[str], tmp_path: Path) -> None:
    out = tmp_path / "stage" / "manifest.json"
    m = write_manifest(datasets, out)
    assert read_manifest(out) == m
    entry = m["datasets"][0]
    assert entry["bin_sha256"] == hashlib.sha256(Path(datasets[0] + ".bin").read_bytes()).hexdigest()
    assert entry["bin_bytes"] == Path(datasets[0] + ".bin").stat().st_size
    assert entry["tokens"] * 4 == entry["bin_bytes"] and entry["dtype"] == "int32"
    assert verify_manifest(out, datasets) == m
    assert verify_manifest(out, list(reversed(datasets))) == m
    assert verify_manifest(out) == m
    assert not [p for p in out.parent.iterdir() if p.name != "manifest.json"]  # no temporary files


def test_missing_extra_and_changed_subsets_fail(datasets: list[str], tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    write_manifest(datasets, out)
    with pytest.raises(ManifestError, match=rf"{datasets[2]}: in the manifest but missing from the dataset list"):
        verify_manifest(out, datasets[:2])
    extra = str(tmp_path / "d")
    write_indexed_dataset(extra, [[1, 2]])
    with pytest.raises(ManifestError, match=rf"{extra}: not in the manifest"):
        verify_manifest(out, [*datasets, extra])
    Path(datasets[1] + ".idx").unlink()
    with pytest.raises(ManifestError, match=rf"{datasets[1]}: missing file"):
        verify_manifest(out, datasets)
    write_indexed_dataset(datasets[1], [[1, 2, 3]])
    with pytest.raises(ManifestError) as err:
        verify_manifest(out, datasets)
    assert f"{datasets[1]}: bin_bytes is 12" in str(err.value) and "tokens is 3" in str(err.value)
    # same sizes, one token changed: only the checksum tells
    write_manifest(datasets, out)
    data = bytearray(Path(datasets[0] + ".bin").read_bytes())
    data[0] ^= 1
    Path(datasets[0] + ".bin").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=rf"{datasets[0]}: bin_sha256 is"):
        verify_manifest(out, datasets)
    verify_manifest(out, datasets, checksums=False)


def test_bad_manifest_files(tmp_path: Path, datasets: list[str]) -> None:
    with pytest.raises(ManifestError, match="no such manifest"):
        read_manifest(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"datasets": []}')
    with pytest.raises(ManifestError, match="not an apertus-dataset-manifest"):
        read_manifest(tmp_path / "other.json")
    with pytest.raises(ManifestError, match="twice"):
        write_manifest([datasets[0], datasets[0]], tmp_path / "x.json")
    with pytest.raises(ManifestError, match="no such file"):
        write_manifest([str(tmp_path / "nope")], tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_manifest_cli(datasets: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "m.json")
    assert main(["manifest", "write", *datasets, "--out", out]) == 0
    assert main(["manifest", "verify", *datasets, "--out", out]) == 0
    assert main(["manifest", "verify", "--out", out]) == 0
    assert "3 datasets match" in capsys.readouterr().out
    assert main(["manifest", "verify", datasets[0], "--out", out]) == 1
    assert "missing from the dataset list" in capsys.readouterr().err


def test_manifest_progress_bars(datasets: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tqdm bars on stderr: bytes hashed (write, verify), datasets read (verify --no-checksums); --no-progress: none."""
    out = str(tmp_path / "m.json")
    total = sum(Path(p + ext).stat().st_size for p in datasets for ext in (".bin", ".idx"))
    assert main(["manifest", "write", *datasets, "--out", out]) == 0
    err = capsys.readouterr().err
    assert "hashing: 100%" in err and f"{total / 1000:.2f}k/{total / 1000:.2f}k" in err
    assert main(["manifest", "verify", "--out", out, "--no-checksums"]) == 0
    err = capsys.readouterr().err
    assert "verifying: 100%" in err and "3/3" in err
    assert main(["manifest", "verify", "--out", out, "--no-progress"]) == 0
    assert "verifying" not in capsys.readouterr().err


def test_inspect_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = VocabSpec()
    I = spec.id  # noqa: E741
    rng = np.random.default_rng(0)
    conv = [I("bos"), I("user_start"), 100, I("user_end"), I("assistant_start"),
            *rng.integers(75, 1000, 120).tolist(), I("assistant_end"), I("eos")]
    write_indexed_dataset(tmp_path / "sft", [[5, 6, 7], conv])
    assert main(["inspect", str(tmp_path / "sft"), "--index", "1", "--json", "--goldfish-k", "3",
                 "--goldfish-h", "4", "--goldfish-variant", "order-sensitive"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = np.array(conv)
    assert got["ids"] == conv
    assert got["sft_mask"] == sft_mask(ids, spec).tolist()
    assert got["goldfish_drop"] == goldfish_drop(ids[1:], k=3, h=4, variant="order-sensitive", spec=spec).tolist()
    assert len(got["sft_mask"]) == len(conv) - 1 and any(got["goldfish_drop"])
    assert main(["inspect", str(tmp_path / "sft"), "--index", "1"]) == 0
    text = capsys.readouterr().out
    assert "<|assistant_start|>" in text and "[+" in text and "trained (SFT mask)" in text
    # decoding with a tokenizer (the small test tokenizer: ids of its own layout)
    apertus_tokenizer_dir = build_test_tokenizer(tmp_path / "tok", VocabSpec.scaled(), with_templates=False)
    small = VocabSpec.from_tokenizer_dir(apertus_tokenizer_dir)
    write_indexed_dataset(tmp_path / "small", [[small.id("assistant_start"), 100, 101, small.id("assistant_end")]])
    assert main(["inspect", str(tmp_path / "small"), "--tokenizer", str(apertus_tokenizer_dir)]) == 0
    assert "<|assistant_end|>" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "sft"), "--index", "7", "--json"]) == 1
    assert "sft.idx: document index 7 out of range" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "none"), "--json"]) == 1
    assert "none.idx: no such file" in capsys.readouterr().err
