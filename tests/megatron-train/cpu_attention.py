"""Test harness: an exact attention for packed sequences (THD) and context parallelism on CPU over gloo.

TEST CODE ONLY. megatron-core's local ``DotProductAttention`` refuses packed sequences and context
parallelism (both are Transformer Engine's, a GPU library), so on CPU neither could run. This
module gives the local spec an attention that does what Transformer Engine's THD attention does,
exactly and slowly:

* each query attends causally to the keys of its own document: the ``cu_seqlens`` segments of the
  ``PackedSeqParams`` (padding included, as the Apertus dataset counts it);
* under context parallelism each rank holds chunks ``r`` and ``2 cp - 1 - r`` of every document
  (the load-balanced order, ``apertus_plugins.core.packing.cp_partition_indices``): the keys and values
  of the whole sequence are gathered over the CP group (an all-gather whose backward sums the
  gradients of every rank and keeps the rank's own part), and every token's global position tells
  which keys it sees;
* without ``packed_seq_params`` and without context parallelism it is megatron-core's own
  ``DotProductAttention`` (the attention-mask path, unchanged).

:func:`install` points megatron-core's ``LocalSpecProvider.core_attention`` at
:class:`PackedAttention`, so every local layer spec built afterwards (the stock GPT spec and the
Apertus spec alike) uses it. ``cpu_patches.install`` calls it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["PackedAttention", "gather_sequence", "packed_attention", "install"]


class _GatherCp(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward: the summed gradient of this rank's part."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        size = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        ctx.rank, ctx.n = torch.distributed.get_rank(group), tensor.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def gather_sequence(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` ([t, ...], this rank's tokens) of every rank of ``group``, concatenated in rank order."""
    return _GatherCp.apply(tensor, group)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: np.ndarray,
                     q_positions: np.ndarray, k_positions: np.ndarray, scale: float) -> torch.Tensor:
    """Causal attention within documents, by global positions.

    ``query`` [tq, heads, d] at global positions ``q_positions``; ``key``/``value`` [tk, groups, d] at
    ``k_positions``; ``cu_seqlens`` the document boundaries of the whole sequence. Returns [tq, heads * d].
    """
    heads, groups = query.shape[1], key.shape[1]
    if heads != groups:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    q_doc = np.searchsorted(cu_seqlens, q_positions, side="right") - 1
    k_doc = np.searchsorted(cu_seqlens, k_positions, side="right") - 1
    allowed = (q_doc[:, None] == k_doc[None, :]) & (k_positions[None, :] <= q_positions[:, None])
    mask = torch.from_numpy(~allowed).to(query.device)
    work = torch.promote_types(query.dtype, torch.float32)  # softmax in float32 at least, as TE's kernels do
    scores = torch.einsum("qhd,khd->hqk", query.to(work), key.to(work)) * scale
    scores = scores.masked_fill(mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.einsum("hqk,khd->qhd", probs, value)
    return out.reshape(out.shape[0], -1)


def _attention_class() -> type:
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from apertus_plugins.core.packing import cp_partition_indices

    class PackedAttention(DotProductAttention):
        """megatron-core's local attention plus THD packed sequences and context parallelism (exact, CPU)."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            cp = config.context_parallel_size
            config.context_parallel_size = 1  # upstream refuses CP here; this class handles it
            try:
                super().__init__(config, *args, **kwargs)
            finally:
                config.context_parallel_size = cp

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Any:
            cp_size = parallel_state.get_context_parallel_world_size()
            if packed_seq_params is None:
                if cp_size > 1:
                    raise RuntimeError("cpu_attention: context parallelism needs packed sequences (cu_seqlens)")
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            if packed_seq_params.qkv_format != "thd":
                raise RuntimeError(f"cpu_attention: qkv_format {packed_seq_params.qkv_format!r} (expected thd)")
            cu_t = packed_seq_params.cu_seqlens_q_padded
            if cu_t is None:
                cu_t = packed_seq_params.cu_seqlens_q
            cu = cu_t.detach().cpu().numpy().astype(np.int64)
            if cp_size > 1:
                group = parallel_state.get_context_parallel_group()
                rank = parallel_state.get_context_parallel_rank()
                key = gather_sequence(key, group)
                value = gather_sequence(value, group)
                q_pos = cp_partition_indices(cu, cp_size, rank)
                k_pos = np.concatenate([cp_partition_indices(cu, cp_size, r) for r in range(cp_size)])
            else:
                q_pos = k_pos = np.arange(int(cu[-1]), dtype=np.int64)
            if query.shape[0] != q_pos.size or key.shape[0] != k_pos.size:
                raise RuntimeError(f"cpu_attention: {query.shape[0]} queries and {key.shape[0]} keys for a sequence "
                                   f"of {int(cu[-1])} positions over {cp_size} CP rank(s)")
            return packed_attention(query, key, value, cu, q_pos, k_pos, self.softmax_scale)

    return PackedAttention


PackedAttention: type | None = None


def install(backends: Any) -> type:
    """Make ``backends.LocalSpecProvider.core_attention`` return :class:`PackedAttention`; returns the class."""
    global PackedAttention
    if PackedAttention is None:
        PackedAttention = _attention_class()
    cls = PackedAttention
    backends.LocalSpecProvider.core_attention = lambda self: cls
    return cls


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: np.ndarray,
                        scale: float | None = None) -> torch.Tensor:
    """Plain causal attention with a dense [t, t] document mask (the check of :func:`packed_attention`)."""
    t, heads, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = key.repeat_interleave(heads // key.shape[1], dim=1)
    v = value.repeat_interleave(heads // value.shape[1], dim=1)
    out = torch.empty_like(query)
    for h in range(heads):
        scores = (query[:, h] @ k[:, h].T) * scale
        keep = torch.from_numpy((documents[:, None] == documents[None, :]) & np.tri(t, dtype=bool))
        scores = scores.masked_fill(~keep, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h]
    return out.reshape(t, -1)
