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

:func:`xielu` is the formula as a composition of torch operations (autograd keeps about ten
intermediate tensors of the input's size for the backward pass). :func:`xielu_fused` computes the
same values with one autograd function that saves only its input and recomputes the rest in the
backward pass, in cache-sized blocks; its values and gradients are bit-identical to
:func:`xielu`'s (the same operations in the same order, the gradients accumulated as autograd
accumulates them), so a model trains the same with either, in float32 as in bfloat16.
"""

from __future__ import annotations

from typing import Any

import torch

from .release import XIELU_ALPHA_INIT, XIELU_BETA, XIELU_EPS

__all__ = ["BETA", "EPS", "ALPHA_INIT", "initial_parameters", "xielu", "xielu_fused", "XIELUFunction"]

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


#: Elements per block of :class:`XIELUFunction` (a few hundred KiB per temporary: cache-resident).
BLOCK = 1 << 16


def _forward_block(x: torch.Tensor, a_p: torch.Tensor, a_n: torch.Tensor, beta: torch.Tensor,
                   eps: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`xielu`'s operations on one block (the same order, so the same rounding), into ``out``."""
    beta_x = beta * x
    positive = a_p * x
    positive.mul_(x).add_(beta_x)
    negative = torch.minimum(x, eps)
    negative.expm1_().sub_(x).mul_(a_n).add_(beta_x)
    torch.where(x > 0, positive, negative, out=out)


def _backward_block(g: torch.Tensor, x: torch.Tensor, a_p: torch.Tensor, a_n: torch.Tensor, beta: torch.Tensor,
                    eps: torch.Tensor, dx: torch.Tensor, prod_p: torch.Tensor, prod_n: torch.Tensor) -> None:
    """The gradient of :func:`xielu` on one block, as autograd computes it through that composition.

    Per element, autograd sends ``g`` through ``where`` (``g_pos``/``g_neg``, zeros elsewhere) and
    accumulates the five uses of ``x`` in the order its engine runs them: ``e - x``, ``minimum``,
    ``t1 * x``, ``a_p * x``, ``beta * x``. ``prod_p``/``prod_n`` receive the products whose sums are
    the gradients of ``a_p``/``a_n`` (summed once over the whole tensor, as autograd sums them).
    """
    positive = x > 0
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    g_pos = torch.where(positive, g, zero)
    g_neg = torch.where(positive, zero, g)
    m = torch.minimum(x, eps)
    e = torch.expm1(m)
    # a_n: grad of (e - x) * a_n
    torch.mul(g_neg, e - x, out=prod_n)
    g_v = g_neg * a_n
    # minimum's gradient: g_m where x < eps, half of it on a tie, 0 where x > eps
    g_m = g_v * (e + 1)
    c2 = torch.where(x == eps, g_m / 2, g_m).masked_fill_(x > eps, 0)
    t1 = a_p * x
    g_t1 = g_pos * x
    torch.mul(g_t1, x, out=prod_p)
    g_bx = g_neg + g_pos
    torch.neg(g_v, out=dx)
    dx.add_(c2).add_(g_pos * t1).add_(g_t1 * a_p).add_(g_bx * beta)


class XIELUFunction(torch.autograd.Function):
    """xIELU of ``x`` given ``a_p = softplus(alpha_p)`` and ``a_n = beta + softplus(alpha_n)``; saves only ``x``.

    ``forward(x, a_p, a_n, beta, eps)`` with ``a_p``/``a_n`` of shape ``[1]`` and ``beta``/``eps``
    0-d tensors in ``x``'s dtype. Blocks of :data:`BLOCK` elements keep the temporaries in cache.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a_p: torch.Tensor, a_n: torch.Tensor, beta: torch.Tensor,
                eps: torch.Tensor) -> torch.Tensor:
        xc = x.contiguous()
        out = torch.empty_like(xc)
        flat_x, flat_o = xc.view(-1), out.view(-1)
        for start in range(0, flat_x.numel(), BLOCK):
            stop = start + BLOCK
            _forward_block(flat_x[start:stop], a_p, a_n, beta, eps, flat_o[start:stop])
        ctx.save_for_backward(xc, a_p, a_n, beta, eps)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a_p, a_n, beta, eps = ctx.saved_tensors
        g = grad.contiguous()
        dx = torch.empty_like(x)
        prod_p = torch.empty_like(x) if ctx.needs_input_grad[1] else None
        prod_n = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        flat = [t.view(-1) for t in (g, x, dx)]
        sp = prod_p.view(-1) if prod_p is not None else torch.empty(min(BLOCK, x.numel()), dtype=x.dtype,
                                                                    device=x.device)
        sn = prod_n.view(-1) if prod_n is not None else torch.empty_like(sp)
        for start in range(0, x.numel(), BLOCK):
            stop = min(start + BLOCK, x.numel())
            pp = sp[start:stop] if prod_p is not None else sp[: stop - start]
            pn = sn[start:stop] if prod_n is not None else sn[: stop - start]
            _backward_block(flat[0][start:stop], flat[1][start:stop], a_p, a_n, beta, eps, flat[2][start:stop], pp, pn)
        grad_p = prod_p.sum_to_size(a_p.shape) if prod_p is not None else None
        grad_n = prod_n.sum_to_size(a_n.shape) if prod_n is not None else None
        return dx, grad_p, grad_n, None, None


def xielu_fused(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor,
                beta: float | torch.Tensor = BETA, eps: float | torch.Tensor = EPS) -> torch.Tensor:
    """:func:`xielu` as one autograd function that keeps only ``x`` for the backward pass (same values, same
    gradients, bit for bit). The softplus of the two scalars stays a plain autograd operation."""
    a_p = torch.nn.functional.softplus(alpha_p)
    a_n = beta + torch.nn.functional.softplus(alpha_n)
    beta_t = beta if isinstance(beta, torch.Tensor) else torch.tensor(beta, dtype=x.dtype, device=x.device)
    eps_t = eps if isinstance(eps, torch.Tensor) else torch.tensor(eps, dtype=x.dtype, device=x.device)
    return XIELUFunction.apply(x, a_p.to(x.dtype), a_n.to(x.dtype), beta_t.to(x.dtype), eps_t.to(x.dtype))
