"""Megatron distributed checkpoints (``torch_dist``) of an Apertus model, for ``apertus convert``.

:func:`save_megatron` writes converted tensors the way Megatron-LM writes a model: an Apertus
``GPTModel`` (:mod:`megatron_patches.spec`, built on CPU) takes the tensors, and its own
``sharded_state_dict()`` is saved with ``megatron.core.dist_checkpointing`` under
``DIR/release/`` with ``DIR/latest_checkpointed_iteration.txt`` saying ``release``. The common
state holds Megatron-LM's ``args`` (the model's arguments, the RoPE scaling among them), so
``--use-checkpoint-args`` and :func:`load_megatron` see the same model. Distributed checkpoints
are resharded on load: one conversion serves any tensor or pipeline parallel layout. Load it with
``--load DIR --finetune`` (or ``--no-load-optim --no-load-rng``): it holds no optimizer state.

``DIR/apertus/`` keeps what the Megatron model does not hold, for the way back: ``config.json``
(the source's configuration), ``passthrough.safetensors`` (the vision and audio tokenizers and the
xIELU constants), ``shape.json`` and the side files of the source (tokenizer, generation config).

Both run in a one-process gloo group (created here unless one exists), as megatron-core's own
unit tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from apertus_plugins.core.release import ROPE_TYPE

from .convert import ConversionError, ConvertedWeights, ModelShape, replace_dir
from .spec import apertus_layer_spec, build_gpt_model, local_to_checkpoint_name
from .version import require_supported

# the version check follows the imports (import order): an unsupported megatron-core stops here with the
# supported range, before anything of this module is defined or run
require_supported()

__all__ = ["TRACKER", "RELEASE", "SIDE_DIR", "single_process_group", "build_cpu_model", "save_megatron",
           "load_megatron", "checkpoint_args", "read_checkpoint_args", "rope_differences"]

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
SIDE_DIR = "apertus"


def single_process_group() -> None:
    """A one-rank gloo process group and megatron-core's model-parallel state (TP = PP = 1), if none exists."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


@contextlib.contextmanager
def _on_host() -> Iterator[None]:
    """Let megatron-core's checkpoint code run where there is no CUDA.

    Its ``torch_dist`` writer and reader assume a GPU in two places: ``torch.cuda.synchronize()``
    after staging tensors on the host, and small bookkeeping tensors (the all-reduced failure flag)
    placed on ``torch.cuda.current_device()``. Without CUDA, every tensor here already lives on the
    host and the process group is gloo, so, inside this block only and only on such a machine, the
    first is a no-op and the second names the CPU. On a machine with CUDA nothing changes.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def transformer_config(shape: ModelShape, dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """The megatron-core ``TransformerConfig`` of an Apertus decoder of ``shape`` (for building on CPU)."""
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels, normalization="RMSNorm", layernorm_epsilon=shape.norm_epsilon,
        qk_layernorm=True, add_bias_linear=False, gated_linear_unit=False, bias_activation_fusion=False,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype,
    )


def build_cpu_model(shape: ModelShape, dtype: torch.dtype = torch.float32) -> Any:
    """An Apertus ``GPTModel`` of ``shape`` on CPU (uninitialized weights)."""
    single_process_group()
    return build_gpt_model(
        transformer_config(shape, dtype), vocab_size=shape.embedding_rows,
        max_sequence_length=shape.max_position_embeddings, rotary_base=int(shape.rope.theta),
        rope_scaling=shape.rope.rope_type == ROPE_TYPE, rope_scaling_factor=shape.rope.factor)


def checkpoint_args(shape: ModelShape, dtype: torch.dtype) -> argparse.Namespace:
    """Megatron-LM's ``args`` for the checkpoint's common state (what ``--use-checkpoint-args`` reads)."""
    a = shape.megatron_args()
    a.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, make_vocab_size_divisible_by=128,
             tokenizer_type=None, add_position_embedding=False, use_rotary_position_embeddings=True,
             rotary_interleaved=False, apply_layernorm_1p=False, ckpt_format="torch_dist",
             params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
             seq_length=min(shape.max_position_embeddings, 8192), iteration=0)
    return argparse.Namespace(**a)


def _named_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters by checkpoint name (Transformer Engine style)."""
    spec = apertus_layer_spec()
    return {local_to_checkpoint_name(n, spec): p for n, p in model.named_parameters()}


def save_megatron(weights: ConvertedWeights, out_dir: str | os.PathLike[str], *, hf_config: dict[str, Any],
                  side_files: dict[str, bytes] | None = None) -> Path:
    """Write ``weights`` as a Megatron ``torch_dist`` checkpoint at ``out_dir`` (see the module docstring).

    The directory appears complete or not at all (written under a temporary name, then renamed).
    """
    from safetensors.torch import save_file

    final = Path(out_dir)
    dtype = weights.tensors["embedding.word_embeddings.weight"].dtype
    model = build_cpu_model(weights.shape, dtype)
    params = _named_tensors(model)
    missing = sorted(set(params) - set(weights.tensors))
    extra = sorted(set(weights.tensors) - set(params))
    if missing or extra:
        raise ConversionError(f"the converted tensors do not fit the Megatron model: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            t = weights.tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ConversionError(f"{name}: shape {tuple(t.shape)}, the Megatron model has {tuple(p.shape)}")
            p.data = t.detach().clone()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / RELEASE).mkdir(parents=True)
    try:
        state = {"model": model.sharded_state_dict(), "args": checkpoint_args(weights.shape, dtype),
                 "checkpoint_version": 3.0, "iteration": 0}
        with _on_host():
            dist_checkpointing.save(state, str(tmp / RELEASE))
        (tmp / TRACKER).write_text(RELEASE)
        side = tmp / SIDE_DIR
        (side / "files").mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in weights.passthrough.items()}, str(side / "passthrough.safetensors"),
                  metadata={"format": "pt"})
        (side / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        (side / "shape.json").write_text(json.dumps(weights.shape.to_json(), indent=2) + "\n")
        for name, data in (side_files or {}).items():
            (side / "files" / name).write_bytes(data)
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _iteration_dir(ckpt: Path) -> Path:
    tracker = ckpt / TRACKER
    if tracker.is_file():
        it = tracker.read_text().strip()
        sub = ckpt / (RELEASE if it == RELEASE else f"iter_{int(it):07d}")
    elif (ckpt / "metadata.json").is_file():
        sub = ckpt  # an iteration directory itself
    else:
        raise ConversionError(f"{ckpt}: no {TRACKER} and no metadata.json (not a Megatron torch_dist checkpoint)")
    if not (sub / "metadata.json").is_file():
        raise ConversionError(f"{sub}: not a torch_dist checkpoint (no metadata.json; legacy 'torch' checkpoints "
                              "are not read here)")
    return sub


def load_megatron(ckpt_dir: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], argparse.Namespace]:
    """Read the model of a Megatron ``torch_dist`` checkpoint: ``(tensors by checkpoint name, Megatron args)``.

    ``ckpt_dir`` is a ``--save`` directory (its tracker file picks the iteration) or an iteration
    directory. Each tensor keeps the dtype it was saved in.
    """
    it_dir = _iteration_dir(Path(ckpt_dir))
    single_process_group()
    with _on_host():
        common = dist_checkpointing.load_common_state_dict(str(it_dir))
    args = common.get("args")
    if args is None:
        raise ConversionError(f"{it_dir}: the checkpoint has no Megatron args in its common state")
    shape = ModelShape.from_megatron_args(args)
    with _on_host():
        stored = dist_checkpointing.load_tensors_metadata(str(it_dir))
    model = build_cpu_model(shape)
    spec = apertus_layer_spec()
    sharded = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
    for v in sharded.values():
        meta = stored.get(v.key)
        if meta is None:
            raise ConversionError(f"{it_dir}: the checkpoint lacks {v.key}")
        v.data = torch.empty(v.data.shape, dtype=meta.dtype)
        v.dtype = meta.dtype
    with _on_host():
        loaded = dist_checkpointing.load({"model": sharded}, str(it_dir))["model"]
    tensors = {local_to_checkpoint_name(k, spec): t for k, t in loaded.items()}
    return tensors, args


def read_checkpoint_args(ckpt_dir: str | os.PathLike[str]) -> argparse.Namespace | None:
    """The Megatron args saved in a ``torch_dist`` checkpoint (``None`` when ``ckpt_dir`` holds none yet)."""
    path = Path(ckpt_dir)
    if not (path / TRACKER).is_file() and not (path / "metadata.json").is_file():
        return None
    it_dir = _iteration_dir(path)
    with _on_host():
        common = dist_checkpointing.load_common_state_dict(str(it_dir))
    return common.get("args")


def rope_differences(saved: Any, run: Any) -> list[str]:
    """RoPE settings of a run that differ from those a checkpoint was trained with.

    Megatron-LM's ``--use-checkpoint-args`` carries ``--rotary-base`` but not ``--use-rope-scaling``
    or ``--rope-scaling-factor``, so a resumed or converted model can silently change its RoPE.
    """
    out = []
    for name in ("rotary_base", "use_rope_scaling", "rope_scaling_factor", "position_embedding_type"):
        a, b = getattr(saved, name, None), getattr(run, name, None)
        if name == "rope_scaling_factor" and not getattr(run, "use_rope_scaling", False) and \
                not getattr(saved, "use_rope_scaling", False):
            continue
        if a is not None and a != b:
            out.append(f"{name}: checkpoint {a!r}, this run {b!r}")
    return out
