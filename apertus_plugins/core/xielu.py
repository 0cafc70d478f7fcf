"""xIELU, the activation of the Apertus MLP (SPEC.md section 5; Huang & Schlag 2024).

With trainable scalars ``p`` and ``n`` (stored as the pre-softplus values, as the released
checkpoint stores ``mlp.act_fn.alpha_p`` / ``alpha_n``), ``beta = 0.5`` and ``eps = -1e-6``::

    alpha_p = softplus(p)
    alpha_n = beta + softplus(n)
    f(x) = alpha_p * x**2 + beta * x                          for x > 0
    f(x) = alpha_n * (expm1(min(x, eps)) - x) + beta * x      otherwise

Initial ``alpha_p = alpha_n = 0.8``, so ``p = log(expm1(0.8))`` and ``n = log(expm1(0.8 - 0.5))``.
This module holds the math as plain torch functions; framework adapters wrap it in their own
module classes (a per-layer module whose ``alpha_p``/``alpha_n`` are trained and weight-decayed).
torch is imported at module import: import this module only where a network runs.
"""

from __future__ import annotations

import torch

from .release import XIELU_ALPHA_INIT, XIELU_BETA, XIELU_EPS

__all__ = ["BETA", "EPS", "ALPHA_INIT", "initial_parameters", "xielu"]

#: beta, eps and the initial alpha_p = alpha_n (after the softplus), from the release's constants.
BETA = XIELU_BETA
EPS = XIELU_EPS
ALPHA_INIT = XIELU_ALPHA_INIT


def initial_parameters(dtype: torch.dtype = torch.float32, alpha_p: float = ALPHA_INIT,
                       alpha_n: float = ALPHA_INIT, beta: float = BETA) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored (pre-softplus) initial values of ``alpha_p`` and ``alpha_n``, each of shape ``[1]``.

    Computed in ``dtype`` (``log(expm1(.))`` of a ``dtype`` scalar), the way the released
    checkpoint's parameters are initialized, so a fresh model matches a fresh port bit for bit.
    """
    p = torch.log(torch.expm1(torch.tensor(alpha_p, dtype=dtype))).unsqueeze(0)
    n = torch.log(torch.expm1(torch.tensor(alpha_n - beta, dtype=dtype))).unsqueeze(0)
    return p, n


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor,
          beta: float | torch.Tensor = BETA, eps: float | torch.Tensor = EPS) -> torch.Tensor:
    """Apply xIELU elementwise; ``alpha_p``/``alpha_n`` are the stored pre-softplus parameters.

    ``beta`` and ``eps`` may be python floats or 0-d tensors (a checkpoint's buffers); they are
    used in ``x``'s dtype.
    """
    a_p = torch.nn.functional.softplus(alpha_p)
    a_n = beta + torch.nn.functional.softplus(alpha_n)
    eps_t = eps if isinstance(eps, torch.Tensor) else torch.tensor(eps, dtype=x.dtype, device=x.device)
    beta_x = beta * x
    positive = a_p * x * x + beta_x
    negative = (torch.expm1(torch.minimum(x, eps_t.to(x.dtype))) - x) * a_n + beta_x
    return torch.where(x > 0, positive, negative)
