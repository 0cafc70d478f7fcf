"""``apertus make-checkpoint`` and ``apertus encode`` as real commands, against the released port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from _encoder_oracles import port_audio_codes
from PIL import Image
from transformers import Apertus1p5ForConditionalGeneration, AutoProcessor

from apertus_plugins.core.media import audio
from apertus_plugins.testing.scripts import run_apertus as apertus

ROOT = Path(__file__).resolve().parents[2]
rng = np.random.default_rng(9)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "ck"
    r = apertus("make-checkpoint", str(out), "--seed", "4", "--shard-size", "400KB")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and (out / "model.safetensors.index.json").is_file()
    return out


def _image(path: Path, h: int, w: int, mode: str = "RGB") -> Path:
    coarse = rng.integers(0, 256, (max(2, h // 25), max(2, w // 25), 3), dtype=np.uint8)
    Image.fromarray(coarse, "RGB").resize((w, h), Image.Resampling.BICUBIC).convert(mode).save(path)
    return path


def test_encode_prints_one_line_per_file_with_the_ports_codes(ckpt, tmp_path):
    files = [
        _image(tmp_path / "a.png", 200, 300),
        tmp_path / "missing.png",
        _image(tmp_path / "b.jpg", 160, 160),
        _image(tmp_path / "c.png", 200, 300, "L"),  # same post-resize shape as a.png: one batch
        tmp_path / "notes.txt",
        tmp_path / "speech.wav",
        tmp_path / "stereo.flac",
        tmp_path / "broken.jpg",
    ]
    (tmp_path / "notes.txt").write_text("not media")
    wave24 = (0.3 * np.sin(np.arange(24_000 + 77) * 0.05) + 0.05 * rng.standard_normal(24_077)).astype(np.float32)
    sf.write(tmp_path / "speech.wav", wave24, 24_000, subtype="FLOAT")
    sf.write(tmp_path / "stereo.flac", (0.2 * rng.standard_normal((16_000 + 5, 2))), 16_000)
    (tmp_path / "broken.jpg").write_bytes((tmp_path / "b.jpg").read_bytes()[:200])
    r = apertus("encode", "--checkpoint", str(ckpt), "--batch-size", "4", *map(str, files))
    assert r.returncode == 1, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["file"] for x in lines] == [str(f) for f in files]
    bad = {Path(x["file"]).name: x["error"] for x in lines if "error" in x}
    assert set(bad) == {"missing.png", "notes.txt", "broken.jpg"}
    assert all(name in msg for name, msg in bad.items())
    assert "broken.jpg" in r.stderr

    port = Apertus1p5ForConditionalGeneration.from_pretrained(ckpt).eval()
    processor = AutoProcessor.from_pretrained(ckpt)
    offset = port.config.image_token_offset
    by_name = {Path(x["file"]).name: x for x in lines if "error" not in x}
    for name in ("a.png", "b.jpg", "c.png"):
        enc = processor(text=processor.tokenizer.image_token, images=[Image.open(tmp_path / name)], return_tensors="pt")
        with torch.inference_mode():
            ref = port.model.get_image_tokens(enc["pixel_values"], enc["image_sizes"])[0] - offset
        got = by_name[name]
        assert got["modality"] == "image" and got["grid"] == [int(s) // 16 for s in enc["image_sizes"][0]]
        assert got["codes"] == ref.tolist(), name
    enc = processor(text=processor.tokenizer.audio_token, audio=[wave24], return_tensors="pt")
    with torch.inference_mode():
        ref = port.model.get_audio_tokens(enc["input_values"], enc["padding_mask"])[0] - port.config.audio_token_offset
    assert by_name["speech.wav"] == {"file": str(tmp_path / "speech.wav"), "modality": "audio", "codes": ref.tolist()}
    clip = audio.preprocess_audio(*audio.load_audio(tmp_path / "stereo.flac"))
    ref = port_audio_codes(port.model.audio_tokenizer, torch.from_numpy(clip)[None])[0]
    assert by_name["stereo.flac"]["codes"] == ref.tolist() and len(ref) == audio.audio_code_count(clip.size)


def test_cli_errors_and_help_without_torch(ckpt, tmp_path):
    _image(tmp_path / "x.png", 64, 64)
    r = apertus("encode", "--checkpoint", str(tmp_path / "nowhere"), str(tmp_path / "x.png"))
    assert r.returncode == 1 and "nowhere" in r.stderr
    r = apertus("make-checkpoint", str(ckpt))
    assert r.returncode == 1 and "exists" in r.stderr
    code = ("import sys; sys.modules['torch'] = None; from apertus_plugins.cli import main; "
            "sys.exit(main(['make-checkpoint', '--help']))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "--shard-size" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; "
                        "from apertus_plugins.testing.checkpoint import "
                        "read_checkpoint_config; c = read_checkpoint_config(sys.argv[1]); "
                        "print(c.vision.codebook_size, c.audio.hop_length)", str(ckpt)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["256", "600"], r.stderr


def test_demo_with_a_checkpoint_fills_in_the_encoders_codes(ckpt):
    """``apertus demo --checkpoint``: the code positions hold the checkpoint's codes (the port's, for the clip)."""
    import re

    from _encoder_oracles import port_audio

    from apertus_plugins.cli.demo import _media_path
    from apertus_plugins.encoders import load_audio_tokenizer

    placeholders = apertus("demo", "--tokenizer", str(ckpt))
    assert placeholders.returncode == 0, placeholders.stderr
    assert "placeholder ids" in placeholders.stdout and "image=0, audio=0" in placeholders.stdout
    r = apertus("demo", "--checkpoint", str(ckpt))
    assert r.returncode == 0, r.stderr
    assert f"codes from the encoders of {ckpt}" in r.stdout
    line = next(row for row in r.stdout.splitlines() if row.startswith("ids per block: "))
    blocks = {k: int(v) for k, v in (kv.split("=") for kv in line.split(": ")[1].split(", "))}
    n_image = int(re.search(r"grid \d+x\d+ = (\d+) codes", r.stdout).group(1))
    n_audio = int(re.search(r"= (\d+) codes, \d+ ids\n", r.stdout).group(1))
    assert (blocks["image"], blocks["audio"]) == (n_image, n_audio)
    # the first audio codes shown are the port's codes of the preprocessed clip
    wave, rate = audio.load_audio(_media_path("demo.wav"))
    clip = torch.from_numpy(audio.preprocess_audio(wave, rate))[None]
    want = port_audio_codes(port_audio(load_audio_tokenizer(ckpt)), clip)[0, :5].tolist()
    line = next(row for row in r.stdout.splitlines() if re.match(r"audio +\d+ +\d+ ", row))  # the layout row
    assert [int(c) for c in re.findall(r"<\|audio token (\d+)\|>", line)] == want
    both = apertus("demo", "--checkpoint", str(ckpt), "--tokenizer", str(ckpt))
    assert both.returncode != 0 and "not both" in both.stderr


def test_encode_twice_with_the_media_cache_encodes_nothing_the_second_time(ckpt, tmp_path):
    files = [_image(tmp_path / "a.png", 200, 300), _image(tmp_path / "b.png", 64, 64), tmp_path / "s.wav"]
    sf.write(tmp_path / "s.wav", (0.2 * rng.standard_normal(12_000)).astype(np.float32), 24_000, subtype="FLOAT")
    cache = tmp_path / "codes"
    plain = apertus("encode", "--checkpoint", str(ckpt), *map(str, files))
    cold = apertus("encode", "--checkpoint", str(ckpt), "--media-cache", str(cache), *map(str, files))
    env_run = subprocess.run(
        [sys.executable, "-m", "apertus_plugins.cli", "encode", "--checkpoint", str(ckpt), *map(str, files)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
             "APERTUS_MEDIA_CACHE": str(cache), "APERTUS_MEDIA_CACHE_SIZE": "10MB"})
    for r in (plain, cold, env_run):
        assert r.returncode == 0, r.stderr
    assert "media cache" not in plain.stderr  # off by default
    assert f"media cache {cache}: 0 hits, 3 misses" in cold.stderr
    assert f"media cache {cache}: 3 hits, 0 misses" in env_run.stderr  # the encoders ran on no item
    assert plain.stdout == cold.stdout == env_run.stdout


def test_weights_fingerprint_follows_every_tensor(ckpt):
    from apertus_plugins.encoders import load_vision_tokenizer
    from apertus_plugins.encoders.cache import forget_fingerprint, weights_fingerprint

    a, b = load_vision_tokenizer(ckpt), load_vision_tokenizer(ckpt)
    fa = weights_fingerprint(a)
    assert fa == weights_fingerprint(b) and len(fa) == 64  # the same files, the same fingerprint
    with torch.no_grad():
        next(iter(b.parameters())).view(-1)[0] += 1e-6
    forget_fingerprint(b)
    assert weights_fingerprint(b) != fa
