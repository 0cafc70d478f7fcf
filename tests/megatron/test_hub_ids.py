"""``apertus convert to-megatron`` and ``apertus tokenize`` with Hub ids, from a local Hugging Face cache.

The cache is laid out as huggingface_hub writes it (:func:`apertus_plugins.infra.hub.add_to_cache`) and
read offline (``HF_HUB_OFFLINE=1``). ``tokenize`` reads the encoders of a checkpoint given by its
id from a cache holding only the encoder shards, takes the checkpoint's own tokenizer when
``--tokenizer`` is not given, writes what the same run on the directories writes, and ends with
the image layout it wrote next to the serving layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _offline_data import cli, workspace
from conftest import tiny_hf_tensors, tiny_text_config, write_hf_dir

from apertus_plugins.cli import main as apertus
from apertus_plugins.core.tensor_names import AUDIO_PREFIX, VISION_PREFIX
from apertus_plugins.infra.hub import add_to_cache
from apertus_plugins.plugins import serving_layout
from megatron_patches.checkpoint import load_megatron

REPO = "apertus-test/Apertus-tiny"


def test_convert_to_megatron_takes_a_hub_id(tmp_path: Path, apertus_offline_hub: dict[str, str], process_group: None,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_text_config()
    hf = write_hf_dir(tmp_path / "hf", cfg, tiny_hf_tensors(cfg))
    add_to_cache(hf, REPO, revision="stage-sft", cache=apertus_offline_hub["HF_HUB_CACHE"])
    assert apertus(["convert", "to-megatron", f"{REPO}@stage-sft", str(tmp_path / "by-id")]) == 0
    assert apertus(["convert", "to-megatron", str(hf), str(tmp_path / "by-dir")]) == 0
    capsys.readouterr()
    by_id, args_id = load_megatron(tmp_path / "by-id")
    by_dir, args_dir = load_megatron(tmp_path / "by-dir")
    assert by_id.keys() == by_dir.keys() and all(torch.equal(by_id[k], by_dir[k]) for k in by_id)
    assert args_id.rope_scaling_factor == args_dir.rope_scaling_factor
    assert apertus(["convert", "to-megatron", f"{REPO}@main", str(tmp_path / "x")]) == 1
    assert f"{REPO}@main is not in the Hugging Face cache" in capsys.readouterr().err


def test_tokenize_reads_a_hub_checkpoint_and_its_own_tokenizer(tmp_path: Path, apertus_offline_hub: dict[str, str]) -> None:
    ws = workspace()
    ckpt = ws.checkpoint
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"] \
        if (ckpt / "model.safetensors.index.json").is_file() else None
    small = [str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.suffix != ".safetensors"]
    if weight_map is None:
        weights = [p.name for p in ckpt.glob("*.safetensors")]
    else:
        weights = sorted({f for n, f in weight_map.items() if n.startswith((VISION_PREFIX, AUDIO_PREFIX))})
    add_to_cache(ckpt, REPO, cache=apertus_offline_hub["HF_HUB_CACHE"], files=[*small, *weights])

    common = [str(ws.folder), "--batch-size", "4", "--no-progress", "--workers", "0"]
    by_id = cli(["pretrain", *common, "--out", str(tmp_path / "by-id"), "--checkpoint", REPO], env=apertus_offline_hub)
    assert by_id.returncode == 0, by_id.stderr[-3000:]
    by_dir = cli(["pretrain", *common, "--out", str(tmp_path / "by-dir"), "--checkpoint", str(ckpt),
                  "--tokenizer", str(ckpt)], env=apertus_offline_hub)
    assert by_dir.returncode == 0, by_dir.stderr[-3000:]
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"by-id{suffix}").read_bytes() == (tmp_path / f"by-dir{suffix}").read_bytes()
    last = by_id.stdout.strip().splitlines()[-1]
    images = json.loads((tmp_path / "by-id.report.json").read_text())["media"]["image"]
    assert last == (f"image layout: training (written, {images:,} images) | {serving_layout('image')} (serving) -- "
                    "they differ: train/serve skew, recorded in the manifest"), by_id.stdout
    inference = cli(["pretrain", *common, "--out", str(tmp_path / "inf"), "--checkpoint", REPO, "--image-layout",
                     "inference"], env=apertus_offline_hub)
    assert inference.returncode == 0, inference.stderr[-3000:]
    assert inference.stdout.strip().splitlines()[-1].endswith("| inference (serving) -- the same")

    none = cli(["pretrain", *common, "--out", str(tmp_path / "none")])
    assert none.returncode == 1 and "give --tokenizer" in none.stderr
    missing = cli(["pretrain", *common, "--out", str(tmp_path / "m"), "--checkpoint", "apertus-test/nothing"],
                  env=apertus_offline_hub)
    assert missing.returncode == 1
    assert "--checkpoint 'apertus-test/nothing': not a local directory, and the Hub model apertus-test/nothing is " \
           "not in the Hugging Face cache" in missing.stderr
