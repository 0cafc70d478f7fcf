"""AdEMAMix and the Apertus weight-decay rule, in the form megatron-core's optimizer setup takes them.

megatron-core builds its optimizer in ``_get_megatron_optimizer_based_on_param_groups``: it creates
the torch optimizer (``Adam(**kwargs)``, its module's ``Adam`` unless it falls back to torch's) and
wraps it (``FP32Optimizer`` or ``Float16OptimizerWithFloat16Params``, whose checkpoints carry every
per-parameter state tensor). Megatron-LM's ``pretrain`` calls it with no way in, so the adapter
wraps it (:func:`megatron_patches.overrides.optimizer_builder`, the reasons there) with what this
module provides:

* ``--apertus-weight-decay-on all``: :func:`apply_weight_decay_rule` gives every parameter group
  ``wd_mult = 1`` (the recipe decays norm gains and the xIELU scalars too; upstream skips 1-D
  parameters);
* ``--apertus-optimizer ademamix``: :class:`MegatronAdEMAMix` takes the Adam keyword arguments
  megatron-core passes, plus beta3 and alpha with their warmups from the ``--apertus-ademamix-*``
  flags; :func:`ademamix_init_state_fn` (the checkpoint-loading template) creates AdEMAMix's three
  state tensors; :func:`check_ademamix_config` refuses the settings AdEMAMix cannot serve.

megatron-core's ``DistributedOptimizer`` checkpoints only Adam's two moments, so AdEMAMix with
``--use-distributed-optimizer`` is refused (its slow EMA would be lost on every save). Nothing here
imports Megatron.
"""

from __future__ import annotations

from typing import Any

import torch

from .ademamix import AdEMAMix, AdEMAMixSettings

__all__ = ["AdEMAMix", "MegatronAdEMAMix", "ademamix_init_state_fn", "apply_weight_decay_rule",
           "check_ademamix_config"]


class MegatronAdEMAMix(AdEMAMix):
    """:class:`AdEMAMix` taking the keyword arguments megatron-core passes to its ``Adam``.

    ``betas`` is Adam's ``(beta1, beta2)``; ``adam_w_mode`` selects decoupled weight decay;
    ``beta3``, ``alpha`` and the warmups come from ``settings`` (bound by
    :func:`megatron_patches.overrides.adam_replaced_by_ademamix`).
    """

    settings: AdEMAMixSettings = AdEMAMixSettings()

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 capturable: bool = False, **unsupported: Any) -> None:
        if capturable:
            raise ValueError("AdEMAMix does not support CUDA-graph capture of the optimizer step")
        if unsupported:
            raise ValueError(f"AdEMAMix cannot take megatron-core's {sorted(unsupported)} (precision-aware "
                             "optimizer options); drop --use-precision-aware-optimizer")
        s = self.settings
        super().__init__(params, lr=lr, betas=(*betas[:2], s.beta3), alpha=s.alpha,
                         alpha_warmup=s.alpha_warmup, beta3_warmup=s.beta3_warmup, eps=eps,
                         weight_decay=weight_decay, decoupled_weight_decay=adam_w_mode)


def ademamix_init_state_fn(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """Create the AdEMAMix state of every parameter that has none (megatron-core's checkpoint-loading hook)."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.init_state(p)  # type: ignore[attr-defined]


def apply_weight_decay_rule(param_groups: list[dict[str, Any]], rule: str) -> None:
    """``rule == "all"``: every megatron-core parameter group decays (``wd_mult = 1``); ``"megatron"``: unchanged.

    Groups that differed only in their weight decay become one group (their parameters in order):
    megatron-core matches a checkpoint's parameter groups to the optimizer's by their settings, and
    two groups with equal settings would collapse into one on load.
    """
    if rule != "all":
        return
    merged: list[dict[str, Any]] = []
    for group in param_groups:
        group["wd_mult"] = 1.0
        settings = {k: v for k, v in group.items() if k != "params"}
        for other in merged:
            if {k: v for k, v in other.items() if k != "params"} == settings:
                other["params"] = list(other["params"]) + list(group["params"])
                break
        else:
            merged.append(group)
    param_groups[:] = merged


def check_ademamix_config(config: Any) -> None:
    """Raise ``ValueError`` for megatron-core optimizer settings AdEMAMix cannot serve."""
    if config.optimizer != "adam":
        raise ValueError(f"--apertus-optimizer ademamix replaces Adam: pass --optimizer adam, not {config.optimizer!r}")
    if config.use_distributed_optimizer:
        raise ValueError("--apertus-optimizer ademamix cannot run with --use-distributed-optimizer: megatron-core's "
                         "DistributedOptimizer checkpoints only Adam's two moments, and AdEMAMix's slow EMA would be "
                         "lost")
    if getattr(config, "optimizer_cpu_offload", False):
        raise ValueError("--apertus-optimizer ademamix does not support --optimizer-cpu-offload")
    if getattr(config, "use_precision_aware_optimizer", False):
        raise ValueError("--apertus-optimizer ademamix does not support --use-precision-aware-optimizer")
