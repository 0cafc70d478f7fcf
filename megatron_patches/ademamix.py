"""AdEMAMix (Pagliardini, Ablin & Grangier 2024), the continued-pretraining optimizer (SPEC.md section 6).

Adam's fast EMA ``m1`` is mixed with a slow EMA ``m2`` of the gradients (``beta3`` close to 1)::

    m1 <- beta1 m1 + (1 - beta1) g
    m2 <- beta3(t) m2 + (1 - beta3(t)) g
    v  <- beta2 v  + (1 - beta2) g^2
    theta <- theta - lr * ( (m1 / (1 - beta1^t) + alpha(t) m2) / (sqrt(v / (1 - beta2^t)) + eps)
                            + weight_decay * theta )

``m2`` has no bias correction. Both ``alpha`` and ``beta3`` can be warmed up (the paper's
schedulers, Apertus: over 100,000 iterations):

* ``alpha(t) = min(t * alpha / T_alpha, alpha)``;
* ``beta3(t) = min(exp(ln(beta1) ln(beta3) / ((1 - t/T) ln(beta3) + (t/T) ln(beta1))), beta3)``,
  a linear interpolation of the EMA's half-life from ``beta1``'s to ``beta3``'s.

``t`` is the optimizer step of the parameter (1 on the first update). The state of a parameter is
``step`` (an int), ``exp_avg`` (``m1``), ``exp_avg_sq`` (``v``) and ``exp_avg_slow`` (``m2``);
``state_dict()``/``load_state_dict()`` checkpoint it like any ``torch.optim`` optimizer.
The Apertus recipe: ``betas=(0.9, 0.999, 0.9999)``, ``alpha=8``, both warmups 100,000,
weight decay 0.1 on every parameter (norm gains and xIELU scalars included).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["AdEMAMix", "AdEMAMixSettings", "alpha_at", "beta3_at", "RECIPE"]

#: SPEC.md section 6: continued pretraining.
RECIPE = {"betas": (0.9, 0.999, 0.9999), "alpha": 8.0, "alpha_warmup": 100_000, "beta3_warmup": 100_000,
          "weight_decay": 0.1}


@dataclass(frozen=True)
class AdEMAMixSettings:
    """What AdEMAMix adds to megatron-core's Adam settings, one documented field each (built once from the
    ``--apertus-ademamix-*`` flags; beta1, beta2, eps, learning rate and weight decay stay Megatron's)."""

    beta3: float = RECIPE["betas"][2]
    """Decay of the slow EMA (Apertus: 0.9999)."""
    alpha: float = RECIPE["alpha"]
    """Weight of the slow EMA in the update (Apertus: 8)."""
    alpha_warmup: int | None = RECIPE["alpha_warmup"]
    """Steps of the linear alpha warmup (None: none; Apertus: 100,000)."""
    beta3_warmup: int | None = RECIPE["beta3_warmup"]
    """Steps of the beta3 warmup (None: none; Apertus: 100,000)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta3 < 1.0:
            raise ValueError(f"AdEMAMix beta3 must lie in [0, 1), got {self.beta3}")
        for name in ("alpha_warmup", "beta3_warmup"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"AdEMAMix {name} must be >= 0 steps, got {value}")
            if value == 0:
                object.__setattr__(self, name, None)

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def alpha_at(step: int, alpha: float, warmup: int | None) -> float:
    """The paper's linear alpha warmup: ``min(step * alpha / warmup, alpha)`` (``alpha`` without warmup)."""
    if not warmup:
        return float(alpha)
    return min(step * alpha / warmup, alpha)


def beta3_at(step: int, beta3: float, beta_start: float, warmup: int | None) -> float:
    """The paper's beta3 warmup: the EMA half-life moves linearly from ``beta_start``'s to ``beta3``'s."""
    if not warmup:
        return float(beta3)
    a = min(step / warmup, 1.0)
    ls, le = math.log(beta_start), math.log(beta3)
    return min(math.exp(ls * le / ((1.0 - a) * le + a * ls)), beta3)


class AdEMAMix(torch.optim.Optimizer):
    """AdEMAMix with the paper's alpha and beta3 warmups (see the module docstring).

    Args:
        params: parameters or parameter groups.
        lr: learning rate (a scheduler may change ``group["lr"]``).
        betas: ``(beta1, beta2, beta3)``; a 2-tuple takes ``beta3`` from the ``beta3`` argument.
        alpha: weight of the slow EMA.
        alpha_warmup: steps of the alpha warmup (``None``/0: none).
        beta3_warmup: steps of the beta3 warmup (``None``/0: none); it starts at ``beta1``.
        eps: added to the denominator.
        weight_decay: decay coefficient (a scheduler may change ``group["weight_decay"]``).
        decoupled_weight_decay: ``True`` (the paper, AdamW-style ``lr * wd * theta``) or ``False``
            (L2: ``wd * theta`` added to the gradient).
        beta3: ``beta3`` when ``betas`` has two entries.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, ...] = (0.9, 0.999, 0.9999),
        alpha: float = 8.0,
        alpha_warmup: int | None = None,
        beta3_warmup: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        beta3: float | None = None,
    ) -> None:
        betas = tuple(float(b) for b in betas)
        if len(betas) == 2:
            if beta3 is None:
                raise ValueError("AdEMAMix: betas has two entries; pass beta3")
            betas = (*betas, float(beta3))
        if len(betas) != 3:
            raise ValueError(f"AdEMAMix: betas must be (beta1, beta2, beta3), got {betas}")
        for name, b in zip(("beta1", "beta2", "beta3"), betas, strict=True):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"AdEMAMix: {name} must lie in [0, 1), got {b}")
        if betas[2] < betas[0] and beta3_warmup:
            raise ValueError(f"AdEMAMix: the beta3 warmup starts at beta1 {betas[0]} and needs beta3 >= beta1, "
                             f"got {betas[2]}")
        if lr < 0 or eps < 0 or weight_decay < 0 or alpha < 0:
            raise ValueError(f"AdEMAMix: lr, eps, weight_decay and alpha must be >= 0, got {lr}, {eps}, "
                             f"{weight_decay}, {alpha}")
        defaults = {"lr": lr, "betas": betas, "alpha": float(alpha), "alpha_warmup": alpha_warmup,
                    "beta3_warmup": beta3_warmup, "eps": eps, "weight_decay": weight_decay,
                    "decoupled_weight_decay": bool(decoupled_weight_decay)}
        super().__init__(params, defaults)

    def init_state(self, p: torch.Tensor) -> dict[str, Any]:
        """Create the (zero) state of ``p`` if it has none; returns it (for checkpoint templates)."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_slow"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            betas = tuple(group["betas"])
            if len(betas) == 2:  # a group given Adam's (beta1, beta2) keeps the default beta3
                betas = (*betas, self.defaults["betas"][2])
            beta1, beta2, beta3_final = betas
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("AdEMAMix does not support sparse gradients")
                state = self.init_state(p)
                state["step"] = int(state["step"]) + 1
                t = state["step"]
                alpha = alpha_at(t, group["alpha"], group["alpha_warmup"])
                beta3 = beta3_at(t, beta3_final, beta1, group["beta3_warmup"])
                if wd and not group["decoupled_weight_decay"]:
                    grad = grad.add(p, alpha=wd)
                m1, m2, v = state["exp_avg"], state["exp_avg_slow"], state["exp_avg_sq"]
                m1.lerp_(grad, 1.0 - beta1)
                m2.lerp_(grad, 1.0 - beta3)
                v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (v / (1.0 - beta2**t)).sqrt_().add_(eps)
                update = (m1 / (1.0 - beta1**t)).add_(m2, alpha=alpha).div_(denom)
                if wd and group["decoupled_weight_decay"]:
                    update.add_(p, alpha=wd)
                p.add_(update, alpha=-lr)
        return loss
