"""Small random checkpoints in the released Apertus 1.5 layout, and a reader for their configs.

:func:`write_checkpoint` (``apertus make-checkpoint DIR``) writes what the released
``Apertus1p5ForConditionalGeneration`` directory holds, at a tiny size: ``config.json`` in the
port's ``Apertus1p5Config`` shape, safetensors with the released tensor names (optionally
sharded with ``model.safetensors.index.json``), the tokenizer with the chat templates (from
:func:`apertus_plugins.testing.tokenizer_builder.build_test_tokenizer`), ``generation_config.json`` whose
stops are ``</s>``, ``<|assistant_end|>`` and ``<|tools_suffix|>``, and ``processor_config.json``
so ``AutoProcessor.from_pretrained(dir)`` works. The tests and the demo of the whole project (the
vLLM plugin, the doctor, the evals, the Megatron conversion) run on such a directory.

The language model is random. ``init="standard"`` (the default) is a training initialization:
normal(0, 0.02) matrices, unit norms, the xIELU initial values, so its next-token distributions
are nearly flat. ``init="varied"`` is for comparing implementations numerically: embedding rows of
scale 1, matrices of scale 1/sqrt(fan-in) (the LM head 3/sqrt(hidden)), norms 1 + N(0, 0.1) and
xIELU alphas off their initial values by N(0, 0.05), so every tensor shapes the output, a wrong
norm, activation parameter or offset changes the greedy tokens, and top-2 margins stand far above
float32 noise. The media encoders get :func:`apertus_plugins.testing.random_weights.init_random_weights`
(calibrated codebooks, so codes vary). Deterministic for a seed; written to a temporary directory
and renamed into place.

:func:`read_checkpoint_config` returns the text, vision and audio configs and the
:class:`~apertus_plugins.core.vocab.VocabSpec` of a checkpoint directory (no torch needed).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apertus_plugins import plugins
from apertus_plugins.core.media import audio as media_audio
from apertus_plugins.core.media import image as media_image
from apertus_plugins.core.release import (
    CONTEXT_LENGTH,
    STOP_TOKENS,
    TERMINATOR,
    XIELU_ALPHA_INIT,
    XIELU_BETA,
    XIELU_EPS,
    rope_parameters,
)
from apertus_plugins.core.tensor_names import AUDIO_PREFIX, EMBEDDING, LANGUAGE_MODEL_PREFIX, LM_HEAD, VISION_PREFIX
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.encoders.config import AudioTokenizerConfig, VisionTokenizerConfig
from apertus_plugins.infra.files import read_json
from apertus_plugins.infra.sizes import parse_size

__all__ = [
    "TextSize", "SIZES", "write_checkpoint", "CheckpointConfig", "read_checkpoint_config",
    "text_config_dict", "INITS", "write_stand_in", "write_zero_safetensors",
]

_LM_DTYPES = ("float32", "bfloat16")
#: Language-model initializations of :func:`write_checkpoint` (see the module docstring).
INITS = ("standard", "varied")


@dataclass(frozen=True)
class TextSize:
    """Sizes of the language model of a test checkpoint (head dimension = hidden / heads)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


#: Named sizes. ``tiny``: hidden 128, 2 layers, 2 heads of dimension 64 (vLLM's CPU attention
#: rejects 16), MLP 256, with the tiny encoders.
SIZES: dict[str, TextSize] = {
    "tiny": TextSize(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     intermediate_size=256),
    "small": TextSize(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=1024),
}


def text_config_dict(size: TextSize, spec: VocabSpec, max_position_embeddings: int = CONTEXT_LENGTH,
                     dtype: str = "float32") -> dict[str, Any]:
    """The ``text_config`` of the port (``Apertus1p5TextConfig``) for ``size`` and ``spec``."""
    if size.hidden_size % size.num_attention_heads:
        raise ValueError(f"hidden size {size.hidden_size} is not a multiple of {size.num_attention_heads} heads")
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": spec.bos_id,
        "dtype": dtype,
        "eos_token_id": spec.eos_id,
        "hidden_act": "xielu",
        "hidden_size": size.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": size.intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "model_type": "apertus1p5_text",
        "num_attention_heads": size.num_attention_heads,
        "num_hidden_layers": size.num_hidden_layers,
        "num_key_value_heads": size.num_key_value_heads,
        "output_vocab_size": spec.text_size,
        "pad_token_id": spec.pad_id,
        "rms_norm_eps": 1e-5,
        "rope_parameters": dict(sorted(rope_parameters().items())),
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": spec.embedding_rows or spec.size,
    }


def _config_json(text: dict[str, Any], vision: VisionTokenizerConfig, audio: AudioTokenizerConfig,
                 spec: VocabSpec, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["Apertus1p5ForConditionalGeneration"],
        "audio_config": audio.to_dict(),
        "audio_token_id": spec.id("audio"),
        "audio_token_offset": spec.modality("audio").offset,
        "dtype": dtype,
        "image_token_id": spec.id("image"),
        "image_token_offset": spec.modality("image").offset,
        "model_type": "apertus1p5",
        "text_config": text,
        "tie_word_embeddings": False,
        "vision_config": vision.to_dict(),
    }


def _processor_config() -> dict[str, Any]:
    """The port's processor files: ``Apertus1p5ImageProcessor`` + ``WavTokenizerFeatureExtractor`` settings.

    Sizes come from the core (pixel budget, 16x16 patches, 24 kHz, hop 600, -3 dBFS); the
    normalization ``x/255`` with mean 0.5 and std 0.5 is the core's ``pixel/127.5 - 1``.
    """
    return {
        "feature_extractor": {
            "feature_extractor_type": "WavTokenizerFeatureExtractor",
            "feature_size": 1,
            "hop_length": media_audio.HOP,
            "normalize_audio": True,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": True,
            "sampling_rate": media_audio.SAMPLE_RATE,
            "target_peak_dB_FS": media_audio.TARGET_PEAK_DBFS,
        },
        "image_processor": {
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_pad": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "Apertus1p5ImageProcessor",
            "image_std": [0.5, 0.5, 0.5],
            "resample": 3,  # bicubic
            "rescale_factor": 1 / 255,
            "size": {"max_pixels": media_image.MAX_PIXELS, "min_pixels": media_image.MIN_PIXELS},
            "spatial_factor": media_image.PATCH,
        },
        "processor_class": "Apertus1p5Processor",
    }


def _generation_config(spec: VocabSpec) -> dict[str, Any]:
    return {
        "bos_token_id": spec.bos_id,
        "eos_token_id": [spec.id(TERMINATOR)] + [spec.id(name) for name in STOP_TOKENS],
        "pad_token_id": spec.pad_id,
    }


def _language_model_tensors(size: TextSize, spec: VocabSpec, gen: Any, dtype: Any,
                            init: str = "standard") -> dict[str, Any]:
    import torch

    h, inter = size.hidden_size, size.intermediate_size
    head_dim = h // size.num_attention_heads
    kv = size.num_key_value_heads * head_dim
    rows = spec.embedding_rows or spec.size
    varied = init == "varied"

    def normal(*shape: int, gain: float = 1.0) -> torch.Tensor:
        """A matrix: std 0.02 (standard), else gain / sqrt(fan-in)."""
        std = gain / math.sqrt(shape[-1]) if varied else 0.02
        return (torch.randn(shape, generator=gen) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        if varied:
            return (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
        return torch.ones(n, dtype=dtype)

    def alpha(value: float) -> torch.Tensor:
        """A stored xIELU alpha: softplus^-1 of ``value`` (plus N(0, 0.05) under "varied")."""
        raw = math.log(math.expm1(value))
        if varied:
            return (raw + 0.05 * torch.randn(1, generator=gen)).to(dtype)
        return torch.tensor([raw], dtype=dtype)

    embed = normal(rows, h, gain=math.sqrt(h))  # scale 1 under "varied"
    out: dict[str, torch.Tensor] = {EMBEDDING: embed}
    for i in range(size.num_hidden_layers):
        pre = f"{LANGUAGE_MODEL_PREFIX}layers.{i}."
        out.update({
            pre + "self_attn.q_proj.weight": normal(h, h),
            pre + "self_attn.k_proj.weight": normal(kv, h),
            pre + "self_attn.v_proj.weight": normal(kv, h),
            pre + "self_attn.o_proj.weight": normal(h, h),
            pre + "self_attn.q_norm.weight": ones(head_dim),
            pre + "self_attn.k_norm.weight": ones(head_dim),
            pre + "mlp.up_proj.weight": normal(inter, h),
            pre + "mlp.down_proj.weight": normal(h, inter),
            pre + "mlp.act_fn.alpha_p": alpha(XIELU_ALPHA_INIT),
            pre + "mlp.act_fn.alpha_n": alpha(XIELU_ALPHA_INIT - XIELU_BETA),
            pre + "mlp.act_fn.beta": torch.tensor(XIELU_BETA, dtype=dtype),
            pre + "mlp.act_fn.eps": torch.tensor(XIELU_EPS, dtype=dtype),
            pre + "attention_layernorm.weight": ones(h),
            pre + "feedforward_layernorm.weight": ones(h),
        })
    out[LANGUAGE_MODEL_PREFIX + "norm.weight"] = ones(h)
    out[LM_HEAD] = normal(spec.text_size, h, gain=3.0)
    return out


def _save_shards(tensors: Mapping[str, Any], out: Path, shard_bytes: int | None) -> None:
    from safetensors.torch import save_file

    names = sorted(tensors)
    sizes = {k: tensors[k].numel() * tensors[k].element_size() for k in names}
    if shard_bytes is None or sum(sizes.values()) <= shard_bytes:
        save_file({k: tensors[k].contiguous() for k in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[list[str]] = [[]]
    used = 0
    for k in names:
        if shards[-1] and used + sizes[k] > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += sizes[k]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in shard}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_checkpoint(out_dir: str | Path, *, size: str | TextSize = "tiny", spec: VocabSpec | None = None,
                     seed: int = 0, dtype: str = "float32", shard_size: int | str | None = None,
                     vision_config: VisionTokenizerConfig | None = None,
                     audio_config: AudioTokenizerConfig | None = None,
                     max_position_embeddings: int = CONTEXT_LENGTH, overwrite: bool = False,
                     init: str = "standard") -> Path:
    """Write a random checkpoint directory in the released layout (see the module docstring).

    Args:
        out_dir: the directory to create (must not exist unless ``overwrite``).
        size: a name in :data:`SIZES` or a :class:`TextSize` (the language model).
        spec: the vocabulary layout (default ``VocabSpec.scaled()`` with the installed modalities' slots; ``VocabSpec()`` is the
            released 266,752-row layout). The encoder codebooks take its image and audio sizes.
        seed: all weights are a function of the seed.
        dtype: ``"float32"`` or ``"bfloat16"`` for the language model; the encoders are always float32.
        shard_size: largest shard in bytes (or ``"50MB"``); ``None`` writes one ``model.safetensors``.
        vision_config, audio_config: encoder sizes (default: the tiny ones, codebooks from ``spec``).
        max_position_embeddings: the context length written in the config.
        overwrite: replace an existing directory.
        init: the language model's initialization, ``"standard"`` or ``"varied"`` (see the module
            docstring; ``"varied"`` for numerical comparisons between implementations).

    Returns:
        The directory.
    """
    import torch

    from apertus_plugins.encoders.audio import AudioTokenizer
    from apertus_plugins.encoders.vision import VisionTokenizer

    from .random_weights import init_random_weights
    from .tokenizer_builder import build_test_tokenizer

    if dtype not in _LM_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; the language model is {' or '.join(_LM_DTYPES)} "
                         "(the encoders are always float32)")
    if init not in INITS:
        raise ValueError(f"init {init!r} is not supported; initializations are {', '.join(INITS)}")
    text_size = SIZES[size] if isinstance(size, str) and size in SIZES else size
    if not isinstance(text_size, TextSize):
        raise ValueError(f"unknown size {size!r}; sizes are {', '.join(SIZES)}")
    spec = spec or plugins.spec(VocabSpec.scaled())
    image_codes, audio_codes = spec.modality("image").size, spec.modality("audio").size
    vision = vision_config or VisionTokenizerConfig.tiny()
    audio = audio_config or AudioTokenizerConfig.tiny()
    if vision_config is None:
        vision = VisionTokenizerConfig(**{**_fields(vision), "codebook_size": image_codes})
    if audio_config is None:
        audio = AudioTokenizerConfig(**{**_fields(audio), "codebook_size": audio_codes})
    if vision.codebook_size != image_codes or audio.codebook_size != audio_codes:
        raise ValueError(f"codebooks ({vision.codebook_size} image, {audio.codebook_size} audio) must match the "
                         f"vocabulary's code blocks ({image_codes}, {audio_codes})")
    if spec.modality("image").end != spec.modality("audio").offset:
        raise ValueError("the image codes must end where the audio codes begin (the port checks this)")
    shard_bytes = parse_size(shard_size)

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        gen = torch.Generator().manual_seed(int(seed))
        lm_dtype = getattr(torch, dtype)
        tensors = _language_model_tensors(text_size, spec, gen, lm_dtype, init)
        vis = VisionTokenizer(vision)
        init_random_weights(vis, seed=int(seed) * 2 + 1)
        aud = AudioTokenizer(audio)
        init_random_weights(aud, seed=int(seed) * 2 + 2)
        tensors.update({VISION_PREFIX + k: v for k, v in vis.state_dict().items()})
        tensors.update({AUDIO_PREFIX + k: v for k, v in aud.state_dict().items()})
        _save_shards(tensors, tmp, shard_bytes)
        text = text_config_dict(text_size, spec, max_position_embeddings, dtype)
        _write_json(tmp / "config.json", _config_json(text, vision, audio, spec, dtype))
        _write_json(tmp / "generation_config.json", _generation_config(spec))
        _write_json(tmp / "processor_config.json", _processor_config())
        build_test_tokenizer(tmp, spec)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_zero_safetensors(path: str | Path, shapes: Mapping[str, Sequence[int]]) -> None:
    """A float32 safetensors file of zeros with ``shapes``, written without torch or the safetensors package
    (the format: the header's length as a little-endian u64, the JSON header padded to 8 bytes, the data)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(int(n) for n in shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def write_stand_in(out_dir: str | Path, shards: Mapping[str, Mapping[str, Sequence[int]]] | None = None, *,
                   spec: VocabSpec | None = None) -> Path:
    """A torch-free stand-in of a released checkpoint in ``out_dir``: the test tokenizer with its templates, a
    ``config.json`` with the tiny text config and the layout's token ids and offsets, the stops in
    ``generation_config.json``, and zero float32 weights in ``shards`` (file name -> tensor name -> shape) with
    their ``model.safetensors.index.json``.

    By default (``shards=None``) two shards hold the embedding and the pruned LM head; a caller that needs
    other tensors (the encoders', say) names the shards itself, the shapes from :func:`text_config_dict`.
    ``spec`` defaults to :meth:`VocabSpec.scaled`. No vision or audio config: the doctor's offline checks and the
    Hub cache read such a directory, nothing loads it.
    """
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    spec = spec or VocabSpec.scaled()
    d = build_test_tokenizer(Path(out_dir), spec)
    text = text_config_dict(SIZES["tiny"], spec)
    config = {"model_type": "apertus1p5", "text_config": text, "image_token_id": spec.id("image"),
              "audio_token_id": spec.id("audio"), "image_token_offset": spec.modality("image").offset,
              "audio_token_offset": spec.modality("audio").offset}
    (d / "config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [spec.eos_id, spec.id("assistant_end"), spec.id("tools_suffix")]}))
    if shards is None:
        shards = {"model-00001-of-00002.safetensors": {EMBEDDING: [text["vocab_size"], text["hidden_size"]]},
                  "model-00002-of-00002.safetensors": {LM_HEAD: [spec.text_size, text["hidden_size"]]}}
    for shard, shapes in shards.items():
        write_zero_safetensors(d / shard, shapes)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: shard for shard, shapes in shards.items() for name in shapes}}))
    return d


def _fields(cfg: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class CheckpointConfig:
    """What other code needs from a checkpoint directory's configs."""

    path: Path
    text: dict[str, Any]
    vision: VisionTokenizerConfig
    audio: AudioTokenizerConfig
    spec: VocabSpec
    raw: dict[str, Any]


def read_checkpoint_config(path: str | Path) -> CheckpointConfig:
    """The text config (dict), the encoder configs and the :class:`VocabSpec` of a checkpoint directory.

    The spec is read from the directory's tokenizer (``VocabSpec.from_tokenizer_dir``) with the
    embedding rows of ``text_config.vocab_size``; the config's token ids and offsets must agree
    with it and the codebooks with the code blocks, else ``ValueError`` names the disagreement.
    """
    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{p}: no config.json (not a checkpoint directory)")
    raw = read_json(cfg_file)
    if raw.get("model_type") != "apertus1p5":
        raise ValueError(f"{cfg_file}: model_type is {raw.get('model_type')!r}, expected 'apertus1p5'")
    for key in ("text_config", "vision_config", "audio_config"):
        if not isinstance(raw.get(key), dict):
            raise ValueError(f"{cfg_file}: no {key}")
    text = raw["text_config"]
    vision = VisionTokenizerConfig.from_dict(raw["vision_config"], f"{cfg_file} vision_config")
    audio = AudioTokenizerConfig.from_dict(raw["audio_config"], f"{cfg_file} audio_config")
    spec = VocabSpec.from_tokenizer_dir(p, embedding_rows=text.get("vocab_size"))
    checks = {
        "image_token_id": spec.id("image"),
        "audio_token_id": spec.id("audio"),
        "image_token_offset": spec.modality("image").offset,
        "audio_token_offset": spec.modality("audio").offset,
    }
    for key, want in checks.items():
        if key in raw and raw[key] != want:
            raise ValueError(f"{cfg_file}: {key} is {raw[key]}, the tokenizer says {want}")
    if vision.codebook_size != spec.modality("image").size:
        raise ValueError(f"{cfg_file}: vision codebook_size {vision.codebook_size} != the tokenizer's "
                         f"{spec.modality('image').size} image codes")
    if audio.codebook_size != spec.modality("audio").size:
        raise ValueError(f"{cfg_file}: audio codebook_size {audio.codebook_size} != the tokenizer's "
                         f"{spec.modality('audio').size} audio codes")
    out_rows = text.get("output_vocab_size")
    if out_rows is not None and out_rows != spec.text_size:
        raise ValueError(f"{cfg_file}: output_vocab_size {out_rows} != the tokenizer's {spec.text_size} text ids")
    return CheckpointConfig(p, text, vision, audio, spec, raw)
