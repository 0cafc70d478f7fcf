"""``write_checkpoint`` (``apertus make-checkpoint``) against the released port (transformers 5.24).

The port's ``Apertus1p5ForConditionalGeneration.from_pretrained`` loads the directory with no
missing, unexpected or mismatched keys, its own ``save_pretrained`` writes exactly the same set
of tensors (names, shapes, dtypes), ``AutoProcessor`` loads the directory, and the port's image and
audio tokens (processor + ``get_image_tokens`` / ``get_audio_tokens``) equal ours end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import Apertus1p5Config, Apertus1p5ForConditionalGeneration, AutoProcessor, GenerationConfig

from apertus_plugins.core.media import audio, image
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.encoders import audio_ids, image_ids, load_media_tokenizers
from apertus_plugins.testing.checkpoint import read_checkpoint_config, write_checkpoint

rng = np.random.default_rng(77)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", seed=3)


@pytest.fixture(scope="module")
def port_model(ckpt: Path) -> Apertus1p5ForConditionalGeneration:
    model, info = Apertus1p5ForConditionalGeneration.from_pretrained(ckpt, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, f"port loading: {info}"
    return model.eval()


def _headers(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def test_port_loads_it_and_saves_the_same_tensor_set(ckpt, port_model, tmp_path):
    port_model.save_pretrained(tmp_path / "resaved")
    assert _headers(tmp_path / "resaved") == _headers(ckpt)
    ours = _tensors(ckpt)
    for name, tensor in port_model.state_dict().items():
        assert torch.equal(tensor, ours[name]), f"{name} changed on load"


def test_config_is_the_ports_shape(ckpt, port_model):
    ours = json.loads((ckpt / "config.json").read_text())
    port = Apertus1p5Config.from_pretrained(ckpt).to_dict()

    def same(a, b, where):
        if isinstance(a, dict):
            for k, v in a.items():
                assert k in b, f"{where}.{k} unknown to the port"
                same(v, b[k], f"{where}.{k}")
        else:
            assert a == b, f"{where}: ours {a!r}, port {b!r}"

    same(ours, port, "config")
    spec = read_checkpoint_config(ckpt).spec
    text = ours["text_config"]
    assert text["vocab_size"] == spec.embedding_rows and text["output_vocab_size"] == spec.text_size
    assert port_model.lm_head.weight.shape[0] == spec.text_size
    assert text["rope_parameters"]["rope_type"] == "llama3" and text["rope_parameters"]["factor"] == 32.0
    assert ours["image_token_offset"] == spec.modality("image").offset == port_model.config.image_token_offset
    assert ours["audio_token_id"] == spec.id("audio")
    gen = GenerationConfig.from_pretrained(ckpt)
    assert gen.eos_token_id == [spec.eos_id, spec.id("assistant_end"), spec.id("tools_suffix")]


def _random_image(h: int, w: int) -> Image.Image:
    coarse = rng.integers(0, 256, (max(2, h // 30), max(2, w // 30), 3), dtype=np.uint8)
    return Image.fromarray(coarse, "RGB").resize((w, h), Image.Resampling.BICUBIC)


def test_image_and_audio_tokens_equal_the_port_end_to_end(ckpt, port_model):
    """processor + get_image_tokens / get_audio_tokens == image_ids / audio_ids from the same directory."""
    processor = AutoProcessor.from_pretrained(ckpt)
    tok = processor.tokenizer
    spec = read_checkpoint_config(ckpt).spec
    vision, audio_tok = load_media_tokenizers(ckpt)
    text_ids = image.text_ids_from_tokenizer(ckpt)
    for h, w in [(90, 200), (300, 300), (640, 128)]:
        img = _random_image(h, w)
        enc = processor(text=f"look {tok.image_token}", images=[img], return_tensors="pt")
        ids = enc["input_ids"][0]
        with torch.inference_mode():
            codes = port_model.model.get_image_tokens(enc["pixel_values"], enc["image_sizes"])[0]
        ids[ids == spec.id("image")] = codes
        ids = ids.tolist()
        start = ids.index(spec.id("img_start"))
        assert ids[start:] == image_ids(vision, img, spec, "inference", text_ids).tolist(), f"image {h}x{w}"
    for n in [601, 24_000 + 5]:
        wave = (0.3 * np.sin(np.arange(n) * rng.uniform(0.01, 0.2)) + 0.05 * rng.standard_normal(n)).astype(np.float32)
        enc = processor(text=f"hear {tok.audio_token}", audio=[wave], return_tensors="pt")
        ids = enc["input_ids"][0]
        with torch.inference_mode():
            codes = port_model.model.get_audio_tokens(enc["input_values"], enc["padding_mask"])[0]
        assert codes.numel() == audio.audio_code_count(n)
        ids[ids == spec.id("audio")] = codes
        ids = ids.tolist()
        start = ids.index(spec.id("audio_start"))
        assert ids[start:] == audio_ids(audio_tok, wave, spec, sample_rate=audio.SAMPLE_RATE).tolist(), f"clip {n}"


def test_sharded_bf16_and_deterministic(ckpt, tmp_path):
    again = write_checkpoint(tmp_path / "again", seed=3)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (again / name).read_bytes() == (ckpt / name).read_bytes(), f"{name} differs for the same seed"
    other = write_checkpoint(tmp_path / "other", seed=4)
    assert (other / "model.safetensors").read_bytes() != (ckpt / "model.safetensors").read_bytes()

    sharded = write_checkpoint(tmp_path / "sharded", seed=3, shard_size="300KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (sharded / "model.safetensors").exists()
    ref = _tensors(ckpt)
    got = _tensors(sharded)
    assert set(got) == set(ref) == set(index["weight_map"])
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    model, info = Apertus1p5ForConditionalGeneration.from_pretrained(sharded, output_loading_info=True)
    assert not any(info.values()), info

    bf16 = write_checkpoint(tmp_path / "bf16", seed=3, dtype="bfloat16")
    heads = _headers(bf16)
    for name, (_, dt) in heads.items():
        want = "F32" if name.startswith(("model.vision_tokenizer.", "model.audio_tokenizer.")) else "BF16"
        assert dt == want, f"{name} is {dt}"
    model, info = Apertus1p5ForConditionalGeneration.from_pretrained(bf16, output_loading_info=True)
    assert not any(info.values()), info
    assert model.model.language_model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.vision_tokenizer.quantize.embedding.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        write_checkpoint(tmp_path / "f16", dtype="float16")
    assert not (tmp_path / "f16").exists()


def test_same_seed_same_bytes_whatever_the_thread_count(ckpt, tmp_path):
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            again = write_checkpoint(tmp_path / f"threads{n}", seed=3)
            assert (again / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes(), (
                f"seed 3 written with {n} torch threads differs from the fixture's bytes")
    finally:
        torch.set_num_threads(threads)


def test_varied_init(ckpt, tmp_path):
    """init="varied": the same tensor set and encoders, a language model whose norms and xIELU alphas carry information."""
    varied = write_checkpoint(tmp_path / "varied", seed=3, init="varied")
    ref, got = _tensors(ckpt), _tensors(varied)
    assert set(got) == set(ref) and all(got[k].shape == ref[k].shape for k in ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref if k.startswith(("model.vision_tokenizer.", "model.audio_tokenizer.")))
    for name in ("norm.weight", "q_norm.weight", "act_fn.alpha_p", "act_fn.alpha_n"):
        keys = [k for k in ref if k.startswith("model.language_model.") and k.endswith(name)]
        assert keys and all(not torch.equal(got[k], ref[k]) for k in keys), name
    assert float(got["lm_head.weight"].std()) > 10 * float(ref["lm_head.weight"].std())
    model, info = Apertus1p5ForConditionalGeneration.from_pretrained(varied, output_loading_info=True)
    assert not any(info.values()), info
    with pytest.raises(ValueError, match="standard, varied"):
        write_checkpoint(tmp_path / "bad", init="uniform")
    assert not (tmp_path / "bad").exists()


def test_full_vocabulary_layout(tmp_path):
    """--full: the released 266,752 embedding rows, 131,072 head rows and codebooks; shapes as the port builds them."""
    full = write_checkpoint(tmp_path / "full", spec=VocabSpec(), shard_size="64MB")
    cfg = Apertus1p5Config.from_pretrained(full)
    assert cfg.text_config.vocab_size == 266_752 and cfg.text_config.output_vocab_size == 131_072
    assert cfg.vision_config.codebook_size == 131_072 and cfg.audio_config.codebook_size == 4096
    assert (cfg.image_token_id, cfg.audio_token_id, cfg.image_token_offset, cfg.audio_token_offset) == (
        131_079, 131_085, 131_272, 262_344)
    with torch.device("meta"):
        port = Apertus1p5ForConditionalGeneration(cfg)
    expected = {k: tuple(v.shape) for k, v in port.state_dict().items()}
    assert {k: s for k, (s, _) in _headers(full).items()} == expected
    read = read_checkpoint_config(full)
    assert read.spec.size == 266_440 and read.spec.embedding_rows == 266_752


def test_read_checkpoint_config_checks_agreement(ckpt, tmp_path):
    read = read_checkpoint_config(ckpt)
    assert read.vision.codebook_size == read.spec.modality("image").size
    assert read.audio.hop_length == audio.HOP and read.text["hidden_size"] == 128
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["image_token_offset"] += 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="image_token_offset"):
        read_checkpoint_config(bad)


def test_interrupted_write_leaves_nothing_and_overwrite_replaces(ckpt, tmp_path, monkeypatch):
    import apertus_plugins.testing.tokenizer_builder as tb

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tb, "build_test_tokenizer", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        write_checkpoint(tmp_path / "crash")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    with pytest.raises(FileExistsError):
        write_checkpoint(ckpt)
    out = write_checkpoint(tmp_path / "x", seed=1)
    write_checkpoint(out, seed=3, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]
    from apertus_plugins.infra.sizes import parse_size

    assert parse_size("1.5MB") == 1_572_864
