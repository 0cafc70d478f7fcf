"""One torchrun worker of the bridge test: Megatron-Bridge's public API on a released-layout checkpoint, on CPU.

    torchrun --nproc-per-node 2 bridge_worker.py CKPT REQUEST.json OUT_DIR BAD_CKPT

Run with the megatron-train suite's CPU harness (``cpu_site`` on ``PYTHONPATH``) and this suite's
Transformer Engine import shim (:mod:`te_shim`). For tensor-parallel sizes 1 and 2 (world size 2: at
TP=1 the two ranks are data-parallel replicas) it does what verl's Megatron engine does with a
checkpoint:

1. ``AutoBridge.from_hf_pretrained(CKPT)`` (the Apertus bridge is registered by importing
   ``megatron_patches.bridge``), ``to_megatron_provider(load_weights=True)``, the CPU overrides
   through ``apply_overrides_and_finalize``, ``provide_distributed_model``;
2. the model's forward on REQUEST's ``prompt_ids`` (logits gathered over the TP group, kept over
   the released head's rows);
3. ``export_hf_weights`` back to the released names.

Rank 0 writes ``OUT_DIR/tp{N}.json`` (the model's layer classes, its config flags, the logits) and
``OUT_DIR/tp{N}.safetensors`` (the exported tensors); first, ``OUT_DIR/refused.txt`` gets the error
the bridge gives for BAD_CKPT (a checkpoint whose vocabulary layout differs from its tokenizer's).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import te_shim  # noqa: E402

te_shim.import_megatron_bridge()

from megatron.bridge import AutoBridge  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import (  # noqa: E402
    gather_from_tensor_model_parallel_region,
    model_parallel_cuda_manual_seed,
)
from safetensors.torch import save_file  # noqa: E402

import megatron_patches.bridge  # noqa: E402,F401  (registers the Apertus bridge)

#: What runs on CPU: megatron-core's local modules, no fused kernels, no dropout, fp32.
CPU_OVERRIDES = {
    "gradient_accumulation_fusion": False, "masked_softmax_fusion": False, "apply_rope_fusion": False,
    "bias_dropout_fusion": False, "persist_layer_norm": False, "cross_entropy_loss_fusion": False,
    "attention_dropout": 0.0, "hidden_dropout": 0.0, "use_cpu_initialization": True,
}


def run(ckpt: str, prompt: list[int], head_rows: int, tp: int, out: Path) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0)
    bridge = AutoBridge.from_hf_pretrained(ckpt, torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides={
        **CPU_OVERRIDES, "tensor_model_parallel_size": tp})
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    m = model[0]
    m.eval()
    with torch.no_grad():
        tokens = torch.tensor([prompt])
        logits = m(tokens, torch.arange(len(prompt))[None], None)  # [b, s, vocab / tp]
        logits = gather_from_tensor_model_parallel_region(logits)[0, :, :head_rows].float()
    exported = {name: t.detach().clone().contiguous() for name, t in bridge.export_hf_weights(model, cpu=True)}
    layer = m.decoder.layers[0]
    cfg = m.config
    if torch.distributed.get_rank() == 0:
        save_file(exported, str(out / f"tp{tp}.safetensors"))
        (out / f"tp{tp}.json").write_text(json.dumps({
            "logits": logits.tolist(),
            "provider": type(provider).__name__,
            "mlp": type(layer.mlp).__name__, "activation": type(layer.mlp.activation_func).__name__,
            "q_layernorm": type(layer.self_attention.q_layernorm).__name__,
            "output_rows": int(m.output_layer.weight.shape[0]) * tp,
            "embedding_rows": int(m.embedding.word_embeddings.weight.shape[0]) * tp,
            "untied": not cfg.share_embeddings_and_output_weights and not m.share_embeddings_and_output_weights,
            "gated": cfg.gated_linear_unit, "bias": cfg.add_bias_linear, "qk_layernorm": cfg.qk_layernorm,
            "normalization": cfg.normalization, "rope_scaling": bool(provider.rope_scaling),
            "rope_scaling_factor": float(provider.rope_scaling_factor), "rotary_base": int(provider.rotary_base),
            "trainable": sorted({n.split(".")[0] for n, p in m.named_parameters() if p.requires_grad}),
        }))
    parallel_state.destroy_model_parallel()


def refused(ckpt: str) -> str:
    """The error the bridge gives for a checkpoint whose vocabulary layout differs ('' if none)."""
    from megatron_patches.convert import ConversionError

    try:
        AutoBridge.from_hf_pretrained(ckpt).to_megatron_provider(load_weights=False)
    except ConversionError as exc:
        return str(exc)
    return ""


def main(ckpt: str, request: str, out_dir: str, bad_ckpt: str) -> None:
    req = json.loads(Path(request).read_text())
    out = Path(out_dir)
    torch.distributed.init_process_group("gloo")
    if torch.distributed.get_rank() == 0:
        (out / "refused.txt").write_text(refused(bad_ckpt))
    for tp in (1, 2):
        run(ckpt, [int(t) for t in req["prompt_ids"]], int(req["head_rows"]), tp, out)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        print("bridge worker: done")


if __name__ == "__main__":
    main(*sys.argv[1:5])
