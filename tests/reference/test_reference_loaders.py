"""The strict loaders: a round trip through every format gives the port's codes; bad files fail by name.

Formats: the released layout (unsharded and sharded ``make-checkpoint`` directories, and the port's
standalone tokenizer models saved with ``save_pretrained``), the original Emu3.5 vision tokenizer
(``config.yaml`` + ``model.ckpt``) and the original WavTokenizer Lightning checkpoint (weight norm as
``weight_g`` / ``weight_v``). The original files are written here from the names documented in
SPEC.md 5, with decoder, backbone and training tensors beside the encoder's.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _encoder_oracles import port_audio, port_audio_codes, port_image_codes, port_vision
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Apertus1p5ForConditionalGeneration

from apertus_plugins.encoders import (
    AudioTokenizer,
    AudioTokenizerConfig,
    CheckpointError,
    VisionTokenizer,
    detect_format,
    load_audio_tokenizer,
    load_media_tokenizers,
    load_vision_tokenizer,
)
from apertus_plugins.encoders import loaders as loaders_mod
from apertus_plugins.testing.checkpoint import write_checkpoint
from apertus_plugins.testing.random_weights import random_audio_tokenizer, random_vision_tokenizer

rng = np.random.default_rng(5)
PIXELS = [torch.from_numpy(rng.uniform(-1, 1, (1, 3, h, w)).astype(np.float32)) for h, w in [(128, 128), (96, 224)]]
WAVES = [torch.from_numpy((0.3 * rng.standard_normal((1, n))).astype(np.float32)) for n in (599, 1801, 24_013)]


def _same_vision(loaded: VisionTokenizer, port) -> None:
    for x in PIXELS:
        assert torch.equal(loaded.encode(x), port_image_codes(port, x)), f"codes differ for {tuple(x.shape)}"


def _same_audio(loaded: AudioTokenizer, port) -> None:
    for x in WAVES:
        assert torch.equal(loaded.encode(x), port_audio_codes(port, x)), f"codes differ for {x.shape[-1]} samples"


@pytest.fixture(scope="module")
def vision() -> VisionTokenizer:
    return random_vision_tokenizer(seed=21)


@pytest.fixture(scope="module")
def audio_tok() -> AudioTokenizer:
    return random_audio_tokenizer(seed=22)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "sharded", seed=8, shard_size="100KB")


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "one", seed=8)


# ---------------------------------------------------------------------- released layout
def test_released_layout_sharded_reads_only_encoder_shards(sharded, monkeypatch):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {f for k, f in index.items() if k.startswith(("model.vision_tokenizer.", "model.audio_tokenizer."))}
    assert len(set(index.values()) - needed) >= 1, "no shard holds only language-model tensors"
    opened: list[str] = []
    real = safe_open

    def recording(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr("safetensors.safe_open", recording)
    assert detect_format(sharded) == "released"
    vision, audio_tok = load_media_tokenizers(sharded)
    assert set(opened) <= needed, f"opened language-model shards {set(opened) - needed}"
    monkeypatch.undo()
    port = Apertus1p5ForConditionalGeneration.from_pretrained(sharded).model
    _same_vision(vision, port.vision_tokenizer)
    _same_audio(audio_tok, port.audio_tokenizer)


def test_released_layout_unsharded_and_standalone_port_models(unsharded, vision, audio_tok, tmp_path):
    v, a = load_media_tokenizers(unsharded)
    port = Apertus1p5ForConditionalGeneration.from_pretrained(unsharded).model
    _same_vision(v, port.vision_tokenizer)
    _same_audio(a, port.audio_tokenizer)
    # the port's tokenizer models saved on their own (model_type apertus1p5_vision_tokenizer / wavtokenizer_encoder)
    pv, pa = port_vision(vision), port_audio(audio_tok)
    pv.save_pretrained(tmp_path / "vision")
    pa.save_pretrained(tmp_path / "audio")
    loaded_v = load_vision_tokenizer(tmp_path / "vision")
    loaded_a = load_audio_tokenizer(tmp_path / "audio")
    assert loaded_v.config == vision.config and loaded_a.config == audio_tok.config
    _same_vision(loaded_v, pv)
    _same_audio(loaded_a, pa)


def _rewrite(f: Path, edit) -> None:
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("problem", ["missing", "unexpected", "shape", "half"])
def test_released_layout_errors_name_the_tensor_and_file(unsharded, tmp_path, problem):
    ck = Path(shutil.copytree(unsharded, tmp_path / "ck"))
    f = ck / "model.safetensors"
    name = "model.vision_tokenizer.encoder.conv_out.weight"
    if problem == "missing":
        _rewrite(f, lambda t: t.pop(name))
        match = rf"missing: '{re.escape(name)}'"
    elif problem == "unexpected":
        name = "model.vision_tokenizer.encoder.conv_out.extra"
        _rewrite(f, lambda t: t.__setitem__(name, torch.zeros(3)))
        match = rf"model\.safetensors: unexpected tensor '{re.escape(name)}'"
    elif problem == "shape":
        _rewrite(f, lambda t: t.__setitem__(name, torch.zeros(2, 2)))
        match = rf"model\.safetensors: tensor '{re.escape(name)}' has shape \[2, 2\]"
    else:
        _rewrite(f, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
        match = rf"model\.safetensors: tensor '{re.escape(name)}' is BF16; half precision is refused"
    with pytest.raises(CheckpointError, match=match):
        load_vision_tokenizer(ck)
    load_audio_tokenizer(ck)  # the audio tokenizer's tensors are intact


# ---------------------------------------------------------------------- Emu3.5 original files
def _emu_name(name: str) -> str:
    m = re.match(r"encoder\.stages\.(\d+)\.layers\.(\d+)\.(resnet|attention)\.(.+)$", name)
    if m:
        return f"encoder.down.{m.group(1)}.{'block' if m.group(3) == 'resnet' else 'attn'}.{m.group(2)}.{m.group(4)}"
    return re.sub(r"^encoder\.stages\.(\d+)\.downsample\.", r"encoder.down.\1.downsample.", name)


def write_emu35(tok: VisionTokenizer, d: Path, nested: bool = False, edit=None) -> Path:
    d.mkdir(parents=True)
    c = tok.config
    args = {"ddconfig": {"double_z": False, "z_channels": c.latent_channels, "resolution": c.resolution,
                         "in_channels": c.in_channels, "out_ch": 3, "ch": c.base_channels,
                         "ch_mult": list(c.channel_multiplier), "num_res_blocks": c.num_res_blocks,
                         "attn_resolutions": list(c.attn_resolutions), "dropout": 0.0},
            "n_embed": c.codebook_size, "embed_dim": c.embed_dim, "beta": 0.25, "use_entropy_loss": False,
            "cosine_similarity": False, "entropy_temperature": 0.01}
    cfg = {"model": {"target": "ibq.IBQ", "params": args}} if nested else args
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    sd = {_emu_name(k): v.clone() for k, v in tok.state_dict().items()}
    sd.update({"decoder.conv_in.weight": torch.zeros(4, 4, 3, 3), "post_quant_conv.weight": torch.zeros(4, 4, 1, 1),
               "loss.discriminator.main.0.weight": torch.zeros(2)})
    if edit:
        edit(sd)
    torch.save({"state_dict": sd, "epoch": 3, "global_step": 100}, d / "model.ckpt")
    return d


def test_emu35_original_files(vision, tmp_path):
    port = port_vision(vision)
    for nested in (False, True):
        d = write_emu35(vision, tmp_path / f"emu{nested}", nested=nested)
        assert detect_format(d) == detect_format(d / "model.ckpt") == "emu3.5"
        loaded = load_vision_tokenizer(d)
        assert loaded.config == vision.config
        _same_vision(loaded, port)
    with pytest.raises(CheckpointError, match="holds no audio tokenizer"):
        load_audio_tokenizer(d)


@pytest.mark.parametrize("problem", ["missing", "unexpected", "shape", "half", "double_z"])
def test_emu35_errors_name_the_tensor_and_file(vision, tmp_path, problem):
    key = "encoder.down.1.block.0.conv2.weight"
    edits = {
        "missing": (lambda sd: sd.pop(key), rf"model\.ckpt: 1 encoder tensor\(s\) missing, e\.g\. '{re.escape(key)}'"),
        "unexpected": (lambda sd: sd.__setitem__("encoder.down.0.block.0.temb_proj.weight", torch.zeros(1)),
                       r"model\.ckpt: unexpected tensor 'encoder\.down\.0\.block\.0\.temb_proj\.weight'"),
        "shape": (lambda sd: sd.__setitem__(key, torch.zeros(1)), rf"model\.ckpt: tensor '{re.escape(key)}' has shape \[1\]"),
        "half": (lambda sd: sd.__setitem__(key, sd[key].half()),
                 rf"model\.ckpt: tensor '{re.escape(key)}' is torch.float16; half precision is refused"),
        "double_z": (None, r"config\.yaml: ddconfig\.double_z"),
    }
    edit, match = edits[problem]
    d = write_emu35(vision, tmp_path / "emu", edit=edit)
    if problem == "double_z":
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        del cfg["ddconfig"]["double_z"]
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CheckpointError, match=match):
        load_vision_tokenizer(d)


# ---------------------------------------------------------------------- WavTokenizer original checkpoint
def _wav_name(name: str) -> str:
    if name.startswith("quantizer.codebook."):
        return "feature_extractor.encodec.quantizer.vq.layers.0._codebook." + name[len("quantizer.codebook."):]
    rest = name[len("encoder.layers."):]
    rest = rest.replace(".conv.parametrizations.weight.original0", ".conv.conv.weight_g")
    rest = rest.replace(".conv.parametrizations.weight.original1", ".conv.conv.weight_v")
    rest = re.sub(r"\.conv\.bias$", ".conv.conv.bias", rest)
    return "feature_extractor.encodec.encoder.model." + rest


def write_wavtokenizer(tok: AudioTokenizer, f: Path, edit=None, extra: dict | None = None) -> Path:
    sd = {_wav_name(k): v.clone() for k, v in tok.state_dict().items()}
    sd.update({"backbone.embed.weight": torch.zeros(8, 4, 7), "head.out.weight": torch.zeros(6, 8),
               "feature_extractor.encodec.decoder.model.0.conv.conv.weight_v": torch.zeros(4, 4, 7),
               "multiperioddisc.discriminators.0.convs.0.weight": torch.zeros(2)})
    if edit:
        edit(sd)
    torch.save({"state_dict": sd, "epoch": 7, **(extra or {})}, f)
    return f


def test_wavtokenizer_original_checkpoint(audio_tok, tmp_path):
    f = write_wavtokenizer(audio_tok, tmp_path / "wavtokenizer_tiny.ckpt")
    assert detect_format(f) == detect_format(tmp_path) == "wavtokenizer"
    loaded = load_audio_tokenizer(f)
    assert loaded.config == audio_tok.config, "sizes read off the tensor shapes"
    _same_audio(loaded, port_audio(audio_tok))
    released = AudioTokenizer(AudioTokenizerConfig())  # the released sizes are inferred too
    shapes = {_wav_name(k): torch.empty(v.shape) for k, v in released.state_dict().items()}
    assert loaders_mod.infer_wavtokenizer_config(shapes) == AudioTokenizerConfig()
    with pytest.raises(CheckpointError, match="holds no vision tokenizer"):
        load_vision_tokenizer(f)


@pytest.mark.parametrize("problem", ["missing", "unexpected", "shape", "half", "pickle"])
def test_wavtokenizer_errors_name_the_tensor_and_file(audio_tok, tmp_path, problem):
    key = "feature_extractor.encodec.encoder.model.4.block.1.conv.conv.weight_v"
    edits = {
        "missing": (lambda sd: sd.pop("feature_extractor.encodec.encoder.model.4.shortcut.conv.conv.bias"),
                    r"w\.ckpt: 1 encoder tensor\(s\) missing, e\.g\. 'feature_extractor\.encodec\.encoder\.model\.4\."
                    r"shortcut\.conv\.conv\.bias'"),
        "unexpected": (lambda sd: sd.__setitem__("feature_extractor.encodec.quantizer.vq.layers.1._codebook.embed",
                                                 torch.zeros(1)),
                       r"w\.ckpt: unexpected tensor 'feature_extractor\.encodec\.quantizer\.vq\.layers\.1\._codebook"),
        "shape": (lambda sd: sd.__setitem__(key, torch.zeros(4, 8, 5)), rf"w\.ckpt: tensor '{re.escape(key)}' has shape"),
        "half": (lambda sd: sd.__setitem__(key, sd[key].bfloat16()),
                 rf"w\.ckpt: tensor '{re.escape(key)}' is torch.bfloat16; half precision is refused"),
        "pickle": (None, r"w\.ckpt: cannot be read with weights_only=True.*allow_pickle=True"),
    }
    edit, match = edits[problem]
    extra = {"hyper_parameters": argparse.Namespace(lr=1e-4)} if problem == "pickle" else None
    f = write_wavtokenizer(audio_tok, tmp_path / "w.ckpt", edit=edit, extra=extra)
    with pytest.raises(CheckpointError, match=match):
        load_audio_tokenizer(f)
    if problem == "pickle":
        _same_audio(load_audio_tokenizer(f, allow_pickle=True), port_audio(audio_tok))


def test_loader_precision_and_format_arguments(sharded, tmp_path):
    from apertus_plugins.encoders import PrecisionError

    with pytest.raises(PrecisionError, match="tf32.*CUDA"):
        load_vision_tokenizer(sharded, precision="tf32")
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        load_audio_tokenizer(sharded, format="gguf")
    with pytest.raises(FileNotFoundError):
        load_vision_tokenizer(tmp_path / "nothing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="not a recognized encoder checkpoint"):
        detect_format(empty)
    shutil.copytree(sharded, tmp_path / "noindex", ignore=shutil.ignore_patterns("*.index.json"))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_vision_tokenizer(tmp_path / "noindex")
