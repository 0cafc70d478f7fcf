"""LoRA adapters for tests: random small adapters in PEFT's on-disk format, and their merged checkpoints.

:func:`write_peft_adapter` writes what ``peft`` saves for a LoRA on the text-only causal LM the verl
plugin trains (:class:`apertus_plugins.hf.modeling.Apertus1p5ForCausalLM`): ``adapter_config.json``
(``peft_type`` ``LORA``, ``r``, ``lora_alpha``, ``target_modules``...) and ``adapter_model.safetensors``
with ``base_model.model.<module>.lora_A.weight`` of shape ``(r, in)`` and ``lora_B.weight`` of shape
``(out, r)``; the module names are the class's own (``model.language_model.layers.N.self_attn.q_proj``...).
PEFT applies ``W x + (alpha / r) * B A x``; :func:`write_merged_checkpoint` writes the released checkpoint
with ``W + (alpha / r) * B @ A`` on the released tensor names, which must behave exactly like the adapter.
Needs torch, safetensors and transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LORA_TARGETS", "write_merged_checkpoint", "write_peft_adapter"]

#: The decoder's projections a LoRA targets: attention and MLP (the Apertus MLP has no gate).
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def write_peft_adapter(base: str | Path, out: str | Path, *, rank: int = 8, alpha: int = 16,
                       targets: Sequence[str] = LORA_TARGETS, seed: int = 0, b_std: float = 0.05) -> dict:
    """Write a random LoRA adapter (non-zero A and B) for ``base``'s text-only causal LM into ``out``.

    Returns ``{released tensor name: (alpha / rank) * B @ A}`` (float32), the update each targeted
    weight gets when the adapter is merged.
    """
    import torch
    from safetensors.torch import save_file

    from apertus_plugins.hf.modeling import Apertus1p5ForCausalLM

    base, out = Path(base), Path(out)
    model = Apertus1p5ForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    scale = alpha / rank
    tensors: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets):
            continue
        out_features, in_features = module.weight.shape
        a = torch.randn(rank, in_features, generator=gen) / in_features**0.5
        b = torch.randn(out_features, rank, generator=gen) * b_std
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
        deltas[f"{name}.weight"] = scale * b @ a
    if not deltas:
        raise ValueError(f"{base}: no linear module named one of {list(targets)}")
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
              "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None, "target_modules": list(targets),
              "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return deltas


def write_merged_checkpoint(base: str | Path, deltas: dict, out: str | Path) -> Path:
    """Write ``out``: ``base`` with ``W + delta`` for every ``delta`` (by released tensor name)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from apertus_plugins.core.tensor_names import is_text_tensor
    from apertus_plugins.hf.merge import merge_text_weights, tensor_files

    base, out = Path(base), Path(out)
    trained: dict[str, torch.Tensor] = {}
    for name, file in tensor_files(base).items():
        if is_text_tensor(name):
            with safe_open(str(file), framework="pt") as fh:
                trained[name] = fh.get_tensor(name)
    unknown = sorted(set(deltas) - set(trained))
    if unknown:
        raise ValueError(f"{base}: the adapter's modules are not tensors of the checkpoint: {unknown[:5]}")
    for name, delta in deltas.items():
        trained[name] = (trained[name].float() + delta).to(trained[name].dtype)
    staging = out.with_name(out.name + ".trained")
    staging.mkdir(parents=True)
    save_file(trained, str(staging / "model.safetensors"), metadata={"format": "pt"})
    return merge_text_weights(staging, base, out)
