"""Strict loaders for the media encoders, from three checkpoint formats.

- ``"released"``: a ``transformers`` checkpoint directory of ``Apertus1p5ForConditionalGeneration``
  (``config.json`` with ``vision_config`` / ``audio_config``; safetensors, possibly sharded with
  ``model.safetensors.index.json``; tensors under ``model.vision_tokenizer.`` and
  ``model.audio_tokenizer.``). A directory of the port's standalone tokenizer models
  (``model_type`` ``apertus1p5_vision_tokenizer``, ``wavtokenizer_encoder`` or ``wavtokenizer``)
  loads too. Only the encoder's tensors are read (``safetensors.safe_open``). A Hub id
  (``ORG/NAME[@REVISION]``) names such a checkpoint in the Hugging Face cache; only the config,
  the index and the shards holding the encoder's tensors are fetched (:mod:`apertus_plugins.infra.hub`).
- ``"emu3.5"``: the original Emu3.5 vision tokenizer files, ``config.yaml`` (the keyword arguments of
  the reference ``IBQ`` class: ``ddconfig`` with ``ch``, ``ch_mult``, ``num_res_blocks``,
  ``attn_resolutions``, ``in_channels``, ``resolution``, ``z_channels``, ``double_z: false``,
  ``dropout``; ``n_embed``; ``embed_dim``; training-only keys ignored; also accepted nested under
  ``model.params`` or ``params``) and ``model.ckpt`` (a state dict, or a dict with ``state_dict``;
  names ``encoder.down.I.block.J.*``, ``encoder.down.I.attn.J.*``, ``encoder.down.I.downsample.conv``,
  ``encoder.mid.*``, ``encoder.norm_out``, ``encoder.conv_out``, ``quant_conv``,
  ``quantize.embedding.weight``). Decoder, ``post_quant_conv`` and any other top-level namespace
  are ignored.
- ``"wavtokenizer"``: an original WavTokenizer checkpoint (``.ckpt``; a Lightning ``state_dict``
  or a bare state dict) with ``feature_extractor.encodec.encoder.model.N.*`` (weight norm as
  ``weight_g`` / ``weight_v``) and ``feature_extractor.encodec.quantizer.vq.layers.0._codebook.*``.
  The sizes are read off the tensor shapes (or given as ``config``); the backbone, head, SEANet
  decoder and discriminators are ignored.

Strict everywhere: inside the encoder's namespace a missing or unexpected tensor, a wrong shape
or a non-float32 (notably half-precision) tensor raises :class:`CheckpointError` naming the tensor
and the file. ``torch.load`` runs with ``weights_only=True`` unless ``allow_pickle=True`` is given
for a trusted file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from apertus_plugins.core.tensor_names import AUDIO_PREFIX, VISION_PREFIX
from apertus_plugins.infra.files import read_json

from .audio import AudioTokenizer, AudioTokenizerConfig
from .precision import check_precision
from .vision import VisionTokenizer, VisionTokenizerConfig

__all__ = [
    "CheckpointError", "FORMATS", "detect_format", "load_vision_tokenizer", "load_audio_tokenizer",
    "load_media_tokenizers", "read_released_config", "read_emu35_config", "infer_wavtokenizer_config",
]

FORMATS = ("released", "emu3.5", "wavtokenizer")
_HALF_ST = {"F16", "BF16"}
_WAV_ENC = "feature_extractor.encodec.encoder.model."
_WAV_VQ = "feature_extractor.encodec.quantizer."


class CheckpointError(ValueError):
    """A checkpoint that does not match the encoder: the message names the tensor and the file."""


def _local(path: str | Path, prefixes: tuple[str, ...]) -> Path:
    """``path``, or the snapshot of the Hub id it names with the shards holding ``prefixes``."""
    from apertus_plugins.infra.hub import local_path, parse_hub_id

    p = Path(path)
    if p.exists() or parse_hub_id(path) is None:
        return p  # a missing path that is no Hub id: detect_format names it
    return local_path(path, weights=prefixes, what="checkpoint")


# ---------------------------------------------------------------------- format detection
def detect_format(path: str | Path) -> str:
    """Which of :data:`FORMATS` ``path`` holds (a directory, or a ``.ckpt`` / ``config.yaml`` file)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such checkpoint file or directory")
    if p.is_dir():
        if (p / "config.json").is_file():
            return "released"
        if (p / "config.yaml").is_file() and (p / "model.ckpt").is_file():
            return "emu3.5"
        ckpts = sorted(p.glob("*.ckpt"))
        if len(ckpts) == 1:
            return "wavtokenizer"
        raise CheckpointError(f"{p}: not a recognized encoder checkpoint (expected config.json + safetensors, "
                              f"config.yaml + model.ckpt, or one WavTokenizer .ckpt; found "
                              f"{sorted(x.name for x in p.iterdir())[:10]})")
    if p.name in ("config.yaml", "model.ckpt") and (p.parent / "config.yaml").is_file() \
            and (p.parent / "model.ckpt").is_file():
        return "emu3.5"
    if p.suffix == ".ckpt":
        return "wavtokenizer"
    if p.name == "config.json":
        return "released"
    raise CheckpointError(f"{p}: not a recognized encoder checkpoint file")


# ---------------------------------------------------------------------- released layout
def read_released_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory, with a clear error when missing or malformed."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise CheckpointError(f"{p}: no config.json")
    return read_json(cfg_file, CheckpointError)


def _safetensors_files(directory: Path, prefix: str) -> dict[Path, list[str]]:
    """Files holding tensors under ``prefix`` -> their names, from the index or the single file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
        out: dict[Path, list[str]] = {}
        for name, fname in weight_map.items():
            if name.startswith(prefix):
                out.setdefault(directory / fname, []).append(name)
        for f in out:
            if not f.is_file():
                raise CheckpointError(f"{index}: shard {f.name} is listed but missing")
        return out
    single = directory / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{directory}: neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as fh:
        return {single: [k for k in fh.keys() if k.startswith(prefix)]}


def _read_safetensors(directory: Path, prefix: str, expected: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The tensors under ``prefix`` (prefix stripped), checked against ``expected`` before reading them."""
    from safetensors import safe_open

    files = _safetensors_files(directory, prefix)
    where: dict[str, Path] = {}
    out: dict[str, torch.Tensor] = {}
    for f, names in files.items():
        with safe_open(str(f), framework="pt") as fh:
            present = set(fh.keys())
            for full in names:
                if full not in present:
                    raise CheckpointError(f"{f}: tensor {full!r} is listed in the index but not in the file")
                name = full[len(prefix):]
                where[name] = f
                if name not in expected:
                    raise CheckpointError(f"{f}: unexpected tensor {full!r} (not part of the encoder)")
                sl = fh.get_slice(full)
                dtype, shape = sl.get_dtype(), list(sl.get_shape())
                if dtype in _HALF_ST:
                    raise CheckpointError(f"{f}: tensor {full!r} is {dtype}; half precision is refused "
                                          "(the encoders run in float32; bf16 flips codes)")
                if dtype != "F32":
                    raise CheckpointError(f"{f}: tensor {full!r} is {dtype}, expected F32")
                if shape != list(expected[name]):
                    raise CheckpointError(f"{f}: tensor {full!r} has shape {shape}, expected {list(expected[name])}")
                out[name] = fh.get_tensor(full)
    missing = sorted(set(expected) - set(out))
    if missing:
        shown = ", ".join(repr(prefix + m) for m in missing[:5])
        raise CheckpointError(f"{directory}: {len(missing)} encoder tensor(s) missing: {shown}"
                              + (" ..." if len(missing) > 5 else ""))
    return out


def _released_vision(path: Path) -> tuple[VisionTokenizerConfig, str]:
    cfg = read_released_config(path)
    mt = cfg.get("model_type")
    if mt == "apertus1p5":
        if "vision_config" not in cfg:
            raise CheckpointError(f"{path}/config.json: no vision_config")
        return VisionTokenizerConfig.from_dict(cfg["vision_config"] or {}, f"{path}/config.json vision_config"), \
            VISION_PREFIX
    if mt == VisionTokenizerConfig.model_type:
        return VisionTokenizerConfig.from_dict(cfg, f"{path}/config.json"), ""
    raise CheckpointError(f"{path}/config.json: model_type {mt!r} holds no vision tokenizer "
                          f"(expected 'apertus1p5' or {VisionTokenizerConfig.model_type!r})")


def _released_audio(path: Path) -> tuple[AudioTokenizerConfig, str]:
    cfg = read_released_config(path)
    mt = cfg.get("model_type")
    if mt == "apertus1p5":
        sub = cfg.get("audio_config") or {}
        if sub.get("model_type", AudioTokenizerConfig.model_type) != AudioTokenizerConfig.model_type:
            raise CheckpointError(f"{path}/config.json: audio_config.model_type is {sub.get('model_type')!r}, "
                                  f"expected {AudioTokenizerConfig.model_type!r}")
        return AudioTokenizerConfig.from_dict(sub, f"{path}/config.json audio_config"), AUDIO_PREFIX
    if mt == AudioTokenizerConfig.model_type:
        return AudioTokenizerConfig.from_dict(cfg, f"{path}/config.json"), ""
    if mt == "wavtokenizer":  # the full codec: the encoder sits under encoder_model.
        return AudioTokenizerConfig.from_dict(cfg, f"{path}/config.json"), "encoder_model."
    raise CheckpointError(f"{path}/config.json: model_type {mt!r} holds no audio tokenizer "
                          f"(expected 'apertus1p5', {AudioTokenizerConfig.model_type!r} or 'wavtokenizer')")


# ---------------------------------------------------------------------- torch.load formats
def _torch_load(f: Path, allow_pickle: bool) -> dict[str, Any]:
    import pickle

    if not f.is_file():
        raise FileNotFoundError(f"{f}: no such checkpoint file")
    try:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=not allow_pickle, mmap=True)
        except RuntimeError as exc:  # legacy (non-zip) serialization cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            obj = torch.load(f, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{f}: cannot be read with weights_only=True ({str(exc).splitlines()[0]}); if you "
                              "trust the file, pass allow_pickle=True") from exc
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{f}: not a readable torch checkpoint ({exc})") from exc
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{f}: expected a state dict (or a dict with 'state_dict'), got {type(obj).__name__}")
    return dict(obj)


def _check_and_collect(source: Mapping[str, Any], rename: Callable[[str], str | None],
                       expected: Mapping[str, torch.Size], f: Path,
                       original: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """Rename ``source``'s keys into the encoder's names (None: ignored) and check them strictly.

    ``original`` maps an encoder name back to the file's own name (for messages about missing tensors).
    """
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, value in source.items():
        name = rename(key)
        if name is None:
            continue
        if name not in expected:
            raise CheckpointError(f"{f}: unexpected tensor {key!r} (no {name!r} in the encoder)")
        if name in out:
            raise CheckpointError(f"{f}: tensors {origin[name]!r} and {key!r} both map to {name!r}")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{f}: entry {key!r} is a {type(value).__name__}, not a tensor")
        if value.dtype in (torch.float16, torch.bfloat16):
            raise CheckpointError(f"{f}: tensor {key!r} is {value.dtype}; half precision is refused "
                                  "(the encoders run in float32; bf16 flips codes)")
        if value.dtype != torch.float32:
            raise CheckpointError(f"{f}: tensor {key!r} is {value.dtype}, expected torch.float32")
        if value.shape != expected[name]:
            raise CheckpointError(f"{f}: tensor {key!r} has shape {list(value.shape)}, expected "
                                  f"{list(expected[name])} (for {name!r})")
        out[name], origin[name] = value, key
    missing = sorted(set(expected) - set(out))
    if missing:
        raise CheckpointError(f"{f}: {len(missing)} encoder tensor(s) missing, e.g. " + ", ".join(
            f"{original(m)!r} (for {m!r})" for m in missing[:5]) + (" ..." if len(missing) > 5 else ""))
    return out


def _emu_rename(key: str) -> str | None:
    if not key.startswith(("encoder.", "quant_conv.", "quantize.")):
        return None  # decoder., post_quant_conv., loss. ...: not part of the encoder
    m = re.match(r"encoder\.down\.(\d+)\.(block|attn)\.(\d+)\.(.+)$", key)
    if m:
        part = "resnet" if m.group(2) == "block" else "attention"
        return f"encoder.stages.{m.group(1)}.layers.{m.group(3)}.{part}.{m.group(4)}"
    m = re.match(r"encoder\.down\.(\d+)\.downsample\.(.+)$", key)
    if m:
        return f"encoder.stages.{m.group(1)}.downsample.{m.group(2)}"
    return key


def _emu_original(name: str) -> str:
    m = re.match(r"encoder\.stages\.(\d+)\.layers\.(\d+)\.(resnet|attention)\.(.+)$", name)
    if m:
        return f"encoder.down.{m.group(1)}.{'block' if m.group(3) == 'resnet' else 'attn'}.{m.group(2)}.{m.group(4)}"
    return re.sub(r"^encoder\.stages\.(\d+)\.downsample\.", r"encoder.down.\1.downsample.", name)


def _emu_paths(path: Path) -> tuple[Path, Path]:
    d = path if path.is_dir() else path.parent
    return d / "config.yaml", d / "model.ckpt"


def read_emu35_config(path: str | Path) -> VisionTokenizerConfig:
    """The :class:`VisionTokenizerConfig` of an Emu3.5 ``config.yaml`` (see the module docstring)."""
    try:
        import yaml
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("reading an Emu3.5 config.yaml needs PyYAML (pip install pyyaml)") from exc

    cfg_file, _ = _emu_paths(Path(path))
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: no such file (an Emu3.5 tokenizer needs config.yaml beside model.ckpt)")
    try:
        raw = yaml.safe_load(cfg_file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise CheckpointError(f"{cfg_file}: not valid YAML ({exc})") from exc
    node = raw
    for outer in (("model", "params"), ("params",)):
        probe = raw
        for k in outer:
            probe = probe.get(k) if isinstance(probe, Mapping) else None
        if isinstance(probe, Mapping) and "ddconfig" in probe:
            node = probe
    if not isinstance(node, Mapping) or not isinstance(node.get("ddconfig"), Mapping):
        raise CheckpointError(f"{cfg_file}: no 'ddconfig' mapping (expected the IBQ arguments: ddconfig, n_embed, "
                              "embed_dim)")
    dd = node["ddconfig"]
    for key in ("ch", "ch_mult", "num_res_blocks", "attn_resolutions", "resolution", "z_channels"):
        if key not in dd:
            raise CheckpointError(f"{cfg_file}: ddconfig lacks {key!r}")
    for key in ("n_embed", "embed_dim"):
        if key not in node:
            raise CheckpointError(f"{cfg_file}: lacks {key!r}")
    if dd.get("double_z", True):
        raise CheckpointError(f"{cfg_file}: ddconfig.double_z is true (or absent, whose default is true); the IBQ "
                              "encoder outputs z_channels, which needs double_z: false")
    if not dd.get("resamp_with_conv", True):
        raise CheckpointError(f"{cfg_file}: resamp_with_conv: false (average-pool downsampling) is not supported")
    try:
        return VisionTokenizerConfig(
            codebook_size=int(node["n_embed"]), embed_dim=int(node["embed_dim"]),
            latent_channels=int(dd["z_channels"]), in_channels=int(dd.get("in_channels", 3)),
            base_channels=int(dd["ch"]), channel_multiplier=tuple(dd["ch_mult"]),
            num_res_blocks=int(dd["num_res_blocks"]), attn_resolutions=tuple(dd["attn_resolutions"]),
            resolution=int(dd["resolution"]), dropout=float(dd.get("dropout", 0.0)))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{cfg_file}: {exc}") from exc


def _wav_rename(key: str) -> str | None:
    if key.startswith(_WAV_ENC):
        rest = key[len(_WAV_ENC):]
        rest = re.sub(r"\.conv\.conv\.weight_g$", ".conv.parametrizations.weight.original0", rest)
        rest = re.sub(r"\.conv\.conv\.weight_v$", ".conv.parametrizations.weight.original1", rest)
        rest = re.sub(r"\.conv\.conv\.bias$", ".conv.bias", rest)
        return "encoder.layers." + rest
    if key.startswith(_WAV_VQ):
        rest = key[len(_WAV_VQ):]
        m = re.match(r"vq\.layers\.0\._codebook\.(.+)$", rest)
        return "quantizer.codebook." + m.group(1) if m else "quantizer." + rest  # other layers: unexpected
    return None  # backbone., head., feature_extractor.encodec.decoder., discriminators: not the encoder


def _wav_original(name: str) -> str:
    if name.startswith("quantizer.codebook."):
        return _WAV_VQ + "vq.layers.0._codebook." + name[len("quantizer.codebook."):]
    rest = name[len("encoder.layers."):]
    rest = rest.replace(".conv.parametrizations.weight.original0", ".conv.conv.weight_g")
    rest = rest.replace(".conv.parametrizations.weight.original1", ".conv.conv.weight_v")
    return _WAV_ENC + re.sub(r"\.conv\.bias$", ".conv.conv.bias", rest)


def infer_wavtokenizer_config(state: Mapping[str, Any], f: Path | str = "<state dict>") -> AudioTokenizerConfig:
    """An :class:`AudioTokenizerConfig` read off the tensor shapes of an original WavTokenizer state dict.

    Not inferable from weights, and taken from the defaults: ``dilation_growth_rate``,
    ``use_causal_conv``, ``pad_mode`` (the released values).
    """
    def shape(k: str) -> list[int]:
        v = state.get(_WAV_ENC + k)
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"{f}: tensor {_WAV_ENC + k!r} missing (cannot read the encoder sizes)")
        return list(v.shape)

    idx_conv, idx_res, idx_lstm = set(), set(), set()
    lstm_layers = 0
    for key in state:
        if not key.startswith(_WAV_ENC):
            continue
        m = re.match(r"(\d+)\.(conv|block|shortcut|lstm)\.", key[len(_WAV_ENC):])
        if not m:
            continue
        i, kind = int(m.group(1)), m.group(2)
        {"conv": idx_conv, "block": idx_res, "shortcut": idx_res, "lstm": idx_lstm}[kind].add(i)
        lm = re.match(r"\d+\.lstm\.weight_ih_l(\d+)$", key[len(_WAV_ENC):])
        if lm:
            lstm_layers = max(lstm_layers, int(lm.group(1)) + 1)
    if len(idx_lstm) != 1 or 0 not in idx_conv:
        raise CheckpointError(f"{f}: not a WavTokenizer encoder (no single LSTM layer / first convolution under "
                              f"{_WAV_ENC!r})")
    lstm = idx_lstm.pop()
    down = sorted(i for i in idx_conv if 0 < i < lstm)
    if not down:
        raise CheckpointError(f"{f}: no downsampling convolutions under {_WAV_ENC!r}")
    ratios = [shape(f"{i}.conv.conv.weight_v")[-1] // 2 for i in down]
    per_stage = sum(1 for i in idx_res if i < down[0])
    first = shape("0.conv.conv.weight_v")
    last = shape(f"{max(idx_conv)}.conv.conv.weight_v")
    res = shape(f"{min(idx_res)}.block.1.conv.conv.weight_v") if idx_res else None
    embed = state.get(_WAV_VQ + "vq.layers.0._codebook.embed")
    if not isinstance(embed, torch.Tensor):
        raise CheckpointError(f"{f}: tensor {_WAV_VQ + 'vq.layers.0._codebook.embed'!r} missing")
    try:
        return AudioTokenizerConfig(
            audio_channels=first[1], num_filters=first[0], kernel_size=first[2],
            upsampling_ratios=tuple(reversed(ratios)), num_residual_layers=max(per_stage, 1),
            compress=first[0] // res[0] if res else 2, residual_kernel_size=res[2] if res else 3,
            use_conv_shortcut=any(k.startswith(_WAV_ENC) and ".shortcut." in k for k in state),
            num_lstm_layers=lstm_layers, last_kernel_size=last[2], hidden_size=last[0],
            codebook_size=int(embed.shape[0]), codebook_dim=int(embed.shape[1]))
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"{f}: inconsistent WavTokenizer encoder shapes ({exc})") from exc


def _wav_file(path: Path) -> Path:
    if path.is_dir():
        ckpts = sorted(path.glob("*.ckpt"))
        if len(ckpts) != 1:
            raise CheckpointError(f"{path}: expected exactly one .ckpt file, found {[c.name for c in ckpts]}")
        return ckpts[0]
    return path


# ---------------------------------------------------------------------- build
def _expected(factory: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, dict[str, torch.Size]]:
    with torch.device("meta"):
        module = factory()
    return module, {k: v.shape for k, v in module.state_dict().items()}


def _finish(module: torch.nn.Module, state: dict[str, torch.Tensor], device: str | torch.device) -> None:
    module.load_state_dict(state, strict=True, assign=True)
    module.to(device)
    module.eval()


def load_vision_tokenizer(path: str | Path, *, format: str = "auto", device: str | torch.device = "cpu",
                          precision: str = "float32", config: VisionTokenizerConfig | None = None,
                          allow_pickle: bool = False) -> VisionTokenizer:
    """Load the vision tokenizer from a released checkpoint directory or the original Emu3.5 files.

    Args:
        path: a checkpoint directory (released layout), or an Emu3.5 directory / its ``model.ckpt``.
        format: one of :data:`FORMATS` or ``"auto"`` (:func:`detect_format`).
        device: where the weights go.
        precision: ``"float32"`` or ``"tf32"`` (CUDA only).
        config: overrides the sizes read from the checkpoint's config.
        allow_pickle: let ``torch.load`` unpickle arbitrary objects (trusted ``.ckpt`` files only).

    Raises:
        CheckpointError: missing, unexpected, wrongly shaped or non-float32 tensors (named, with the
        file), or an unreadable config.
        HubError: a Hub id that cannot be resolved (see :func:`apertus_plugins.infra.hub.local_path`).
    """
    p = _local(path, (VISION_PREFIX,))
    fmt = detect_format(p) if format == "auto" else format
    check_precision(precision, device)
    if fmt == "released":
        directory = p if p.is_dir() else p.parent
        cfg, prefix = _released_vision(directory)
        module, expected = _expected(lambda: VisionTokenizer(config or cfg, precision))
        state = _read_safetensors(directory, prefix, expected)
    elif fmt == "emu3.5":
        cfg = config or read_emu35_config(p)
        _, ckpt = _emu_paths(p)
        module, expected = _expected(lambda: VisionTokenizer(cfg, precision))
        state = _check_and_collect(_torch_load(ckpt, allow_pickle), _emu_rename, expected, ckpt, _emu_original)
    elif fmt == "wavtokenizer":
        raise CheckpointError(f"{p}: a WavTokenizer checkpoint holds no vision tokenizer")
    else:
        raise ValueError(f"unknown checkpoint format {format!r}; formats are auto, {', '.join(FORMATS)}")
    _finish(module, state, device)
    return module  # type: ignore[return-value]


def load_audio_tokenizer(path: str | Path, *, format: str = "auto", device: str | torch.device = "cpu",
                         precision: str = "float32", config: AudioTokenizerConfig | None = None,
                         allow_pickle: bool = False) -> AudioTokenizer:
    """Load the audio tokenizer from a released checkpoint directory or an original WavTokenizer ``.ckpt``.

    Arguments as :func:`load_vision_tokenizer`; for the original format the sizes are read off the
    tensor shapes unless ``config`` is given.
    """
    p = _local(path, (AUDIO_PREFIX,))
    fmt = detect_format(p) if format == "auto" else format
    check_precision(precision, device)
    if fmt == "released":
        directory = p if p.is_dir() else p.parent
        cfg, prefix = _released_audio(directory)
        module, expected = _expected(lambda: AudioTokenizer(config or cfg, precision))
        state = _read_safetensors(directory, prefix, expected)  # a full codec: backbone/head lie outside
    elif fmt == "wavtokenizer":
        f = _wav_file(p)
        raw = _torch_load(f, allow_pickle)
        cfg = config or infer_wavtokenizer_config(raw, f)
        module, expected = _expected(lambda: AudioTokenizer(cfg, precision))
        state = _check_and_collect(raw, _wav_rename, expected, f, _wav_original)
    elif fmt == "emu3.5":
        raise CheckpointError(f"{p}: an Emu3.5 vision tokenizer holds no audio tokenizer")
    else:
        raise ValueError(f"unknown checkpoint format {format!r}; formats are auto, {', '.join(FORMATS)}")
    _finish(module, state, device)
    return module  # type: ignore[return-value]


def load_media_tokenizers(checkpoint_dir: str | Path, *, device: str | torch.device = "cpu",
                          precision: str = "float32") -> tuple[VisionTokenizer, AudioTokenizer]:
    """Both tokenizers of a released ``Apertus1p5ForConditionalGeneration`` checkpoint directory (or Hub id)."""
    p = _local(checkpoint_dir, (VISION_PREFIX, AUDIO_PREFIX))
    if detect_format(p) != "released":
        raise CheckpointError(f"{p}: not a released checkpoint directory (config.json + safetensors)")
    return (load_vision_tokenizer(p, format="released", device=device, precision=precision),
            load_audio_tokenizer(p, format="released", device=device, precision=precision))
