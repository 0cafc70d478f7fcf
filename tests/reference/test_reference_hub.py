"""The media encoders, ``apertus encode`` and ``merge-text-weights`` from a Hub id in a local Hugging Face cache.

The checkpoint is a small random one in the released layout, sharded so that the language model
and the encoders lie in different files; the cache (written as huggingface_hub lays it out) holds
only the small files and the encoder shards, which is what the loaders fetch through
``allow_patterns``. Everything runs offline (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from apertus_plugins.core.tensor_names import AUDIO_PREFIX, VISION_PREFIX
from apertus_plugins.infra.hub import HubError, add_to_cache
from apertus_plugins.testing.scripts import run_apertus as apertus

REPO = "apertus-test/Apertus-tiny-random"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hub") / "ck"
    r = apertus("make-checkpoint", str(out), "--seed", "5", "--shard-size", "400KB")
    assert r.returncode == 0, r.stderr
    return out


def _encoder_only_cache(ckpt: Path, cache: str) -> tuple[Path, list[str]]:
    """The cache as allow_patterns leaves it for the encoders; returns the snapshot and the shards left out."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    encoder = {f for n, f in weight_map.items() if n.startswith((VISION_PREFIX, AUDIO_PREFIX))}
    others = sorted(set(weight_map.values()) - encoder)
    assert encoder and others, "the test checkpoint must keep the language model in shards of its own"
    small = [str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.suffix != ".safetensors"]
    return add_to_cache(ckpt, REPO, cache=cache, files=[*small, *sorted(encoder)]), others


def test_the_encoders_load_from_a_cache_holding_only_their_shards(ckpt: Path, apertus_offline_hub: dict[str, str]) -> None:
    from apertus_plugins.encoders import load_audio_tokenizer, load_media_tokenizers, load_vision_tokenizer

    snap, others = _encoder_only_cache(ckpt, apertus_offline_hub["HF_HUB_CACHE"])
    assert not any((snap / f).exists() for f in others)
    vision, audio = load_media_tokenizers(REPO)
    want_v, want_a = load_media_tokenizers(ckpt)
    for got, want in ((vision, want_v), (audio, want_a)):
        a, b = got.state_dict(), want.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_vision_tokenizer(f"{REPO}@main").state_dict().keys() == want_v.state_dict().keys()
    assert load_audio_tokenizer(f"{REPO}@{snap.name}").state_dict().keys() == want_a.state_dict().keys()
    with pytest.raises(HubError, match=r"apertus-test/nothing is not in the Hugging Face cache"):
        load_media_tokenizers("apertus-test/nothing")


def test_encode_takes_a_hub_id(ckpt: Path, apertus_offline_hub: dict[str, str], tmp_path: Path) -> None:
    _encoder_only_cache(ckpt, apertus_offline_hub["HF_HUB_CACHE"])
    img = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(img)
    by_id = apertus("encode", "--checkpoint", REPO, str(img), env=apertus_offline_hub)
    by_dir = apertus("encode", "--checkpoint", str(ckpt), str(img), env=apertus_offline_hub)
    assert by_id.returncode == 0 and by_dir.returncode == 0, by_id.stderr + by_dir.stderr
    assert json.loads(by_id.stdout) == json.loads(by_dir.stdout)
    missing = apertus("encode", "--checkpoint", "apertus-test/nothing@v1", str(img), env=apertus_offline_hub)
    assert missing.returncode == 1
    assert "checkpoint 'apertus-test/nothing@v1': not a local directory, and the Hub model apertus-test/nothing@v1 " \
           "is not in the Hugging Face cache" in missing.stderr


def test_merge_text_weights_takes_hub_ids(ckpt: Path, apertus_offline_hub: dict[str, str], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    add_to_cache(ckpt, REPO, cache=apertus_offline_hub["HF_HUB_CACHE"])
    r = apertus("merge-text-weights", REPO, f"{REPO}@main", str(tmp_path / "out"), env=apertus_offline_hub)
    assert r.returncode == 0, r.stderr
    merged = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    released = {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert merged.keys() == released.keys() and all(torch.equal(merged[k], released[k]) for k in merged)
    assert (tmp_path / "out" / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
