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

:func:`xielu` is the formula as a composition of torch operations (autograd keeps intermediates
of about four times the input's size for the backward pass, boolean masks included).
:func:`xielu_fused` computes the same values with one autograd function that saves only its input
and recomputes the rest in the backward pass, in cache-sized blocks; its values and gradients are bit-identical to
:func:`xielu`'s (the same operations in the same order, the gradients accumulated as autograd
accumulates them; zeros may differ in sign), so a model trains the same with either, in float32 as
in bfloat16. :func:`xielu_inference` is the forward alone for serving (no autograd): the
scalars' softplus computed once by the caller, :func:`xielu`'s operations in its order on reused
temporaries, bit-identical to :func:`xielu` for every input. In :func:`xielu_fused` the branches
are blended arithmetically, which needs both to be finite: an input whose square overflows (``|x|`` above about 1e19) gives NaN where the formula gives one branch's value.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .release import XIELU_ALPHA_INIT, XIELU_BETA, XIELU_EPS

__all__ = ["BETA", "EPS", "ALPHA_INIT", "initial_parameters", "xielu", "xielu_fused", "xielu_inference", "XIELUFunction"]

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


def xielu_inference(x: torch.Tensor, a_p: torch.Tensor, a_n: torch.Tensor,
                    beta: float | torch.Tensor = BETA, eps: float | torch.Tensor = EPS) -> torch.Tensor:
    """:func:`xielu` without autograd, from the activated scalars ``a_p = softplus(alpha_p)`` and
    ``a_n = beta + softplus(alpha_n)`` (computed once, not per call).

    The same operations on the same operands in the same order as :func:`xielu`, so the same
    rounding and the same value for every input (NaN, infinities and signed zeros included: the
    branches are selected with ``where``), with five temporaries fewer: the positive and negative
    branches are computed in place and the selection writes into the positive one. For serving,
    where the per-operation overhead of a small decode batch is a visible part of a step.
    ``beta``/``eps`` are floats or 0-d tensors (a checkpoint's buffers), as for :func:`xielu`.
    """
    beta_x = beta * x
    out = a_p * x
    out.mul_(x).add_(beta_x)  # positive = a_p * x * x + beta_x
    eps_t = eps if isinstance(eps, torch.Tensor) else torch.tensor(eps, dtype=x.dtype, device=x.device)
    negative = torch.minimum(x, eps_t.to(x.dtype))
    negative.expm1_().sub_(x).mul_(a_n).add_(beta_x)
    return torch.where(x > 0, out, negative, out=out)


#: Elements per block of :class:`XIELUFunction` (a few hundred KiB per temporary: cache-resident).
BLOCK = 1 << 16

_HOST_BUFFERS = threading.local()


def _products(x: torch.Tensor) -> torch.Tensor:
    """A ``[2, *x.shape]`` buffer for the alpha gradients' products (consumed before the backward returns).

    On the host it is kept per thread and reused: the C allocator hands large blocks back to the
    system when freed, and faulting a fresh activation-sized buffer in costs more than the products
    themselves. Device memory comes from torch's caching allocator and is allocated each time.
    """
    if x.device.type != "cpu":
        return torch.empty((2, *x.shape), dtype=x.dtype, device=x.device)
    held = getattr(_HOST_BUFFERS, "buffer", None)
    if held is None or held.dtype != x.dtype or held.numel() < 2 * x.numel():
        held = torch.empty(2 * x.numel(), dtype=x.dtype)
        _HOST_BUFFERS.buffer = held
    return held[: 2 * x.numel()].view(2, *x.shape)


def _forward_block(x: torch.Tensor, a_p: torch.Tensor, a_n: torch.Tensor, beta: torch.Tensor,
                   eps: torch.Tensor, out: torch.Tensor, scratch: list[torch.Tensor]) -> None:
    """:func:`xielu`'s operations on one block (the same order, so the same rounding), into ``out``.

    ``where(x > 0, positive, negative)`` becomes ``lerp(negative, positive, m)`` with the 0/1 mask
    ``m`` in ``x``'s dtype: ATen's ``lerp`` returns ``start`` for weight 0 and ``end`` for weight 1
    exactly, and runs at the speed of arithmetic (``where`` on boolean masks is an order of
    magnitude slower on CPU). ``scratch`` holds three block-sized buffers.
    """
    mask, beta_x, negative = scratch
    torch.gt(x, 0, out=mask)
    torch.mul(x, beta, out=beta_x)
    torch.mul(x, a_p, out=out)
    out.mul_(x).add_(beta_x)  # positive = a_p * x * x + beta_x
    torch.minimum(x, eps, out=negative)
    negative.expm1_().sub_(x).mul_(a_n).add_(beta_x)
    torch.lerp(negative, out, mask, out=out)


def _backward_block(g: torch.Tensor, x: torch.Tensor, a_p: torch.Tensor, a_n: torch.Tensor, beta: torch.Tensor,
                    eps: torch.Tensor, dx: torch.Tensor, prod_p: torch.Tensor, prod_n: torch.Tensor,
                    scratch: list[torch.Tensor], zero: torch.Tensor) -> None:
    """The gradient of :func:`xielu` on one block, as autograd computes it through that composition.

    Autograd sends ``g`` through ``where`` (``g`` to one branch, zero to the other) and accumulates
    the five uses of ``x`` in the order its engine runs them: ``e - x``, ``minimum``, ``t1 * x``,
    ``a_p * x``, ``beta * x`` (whose gradient ``g_pos + g_neg`` is ``g``). Where ``x > 0`` the
    negative branch's terms are zeros, so the sum is ``((g * t1) + ((g * x) * a_p)) + g * beta``;
    elsewhere it is ``(g_m * f - g * a_n) + g * beta`` with ``g_m = (g * a_n) * (e + 1)`` (expm1's
    gradient) and ``f`` minimum's: 1 below ``eps``, 0.5 on a tie, 0 above. Both are computed and
    blended with the exact ``lerp`` on the 0/1 mask. ``prod_p``/``prod_n`` receive the products
    whose sums are the gradients of ``a_p``/``a_n`` (``(g * x) * x`` and ``g * (e - x)`` on their
    branch, zero on the other), summed once over the whole tensor as autograd sums them. Zeros
    may differ in sign from autograd's; values do not. ``scratch`` holds six block-sized buffers.
    """
    mask, pos, neg, e, gb, f = scratch
    torch.gt(x, 0, out=mask)
    # positive branch: ((g * t1) + ((g * x) * a_p)) + g * beta
    torch.mul(g, x, out=neg)
    torch.mul(neg, x, out=prod_p)
    prod_p.mul_(mask)
    torch.mul(x, a_p, out=pos)
    pos.mul_(g).add_(neg.mul_(a_p)).add_(torch.mul(g, beta, out=gb))
    # negative branch: (g_m * f - g * a_n) + g * beta
    torch.minimum(x, eps, out=e)
    e.expm1_()
    torch.sub(e, x, out=prod_n)
    prod_n.mul_(g)
    torch.lerp(prod_n, zero, mask, out=prod_n)  # zero where x > 0
    torch.mul(g, a_n, out=neg)
    e.add_(1).mul_(neg)  # g_m
    torch.lt(x, eps, out=f)
    f.add_(torch.eq(x, eps, out=dx), alpha=0.5)  # dx as scratch until the blend
    e.mul_(f).sub_(neg).add_(gb)
    torch.lerp(e, pos, mask, out=dx)


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
        size = min(BLOCK, flat_x.numel())
        scratch = [torch.empty(size, dtype=x.dtype, device=x.device) for _ in range(3)]
        for start in range(0, flat_x.numel(), BLOCK):
            stop = min(start + BLOCK, flat_x.numel())
            _forward_block(flat_x[start:stop], a_p, a_n, beta, eps, flat_o[start:stop],
                           [t[: stop - start] for t in scratch])
        ctx.save_for_backward(xc, a_p, a_n, beta, eps)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a_p, a_n, beta, eps = ctx.saved_tensors
        g = grad.contiguous()
        dx = torch.empty_like(x)
        prod_p, prod_n = _products(x) if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else (None, None)
        flat = [t.view(-1) for t in (g, x, dx)]
        size = min(BLOCK, x.numel())
        scratch = [torch.empty(size, dtype=x.dtype, device=x.device) for _ in range(6)]
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        sp = prod_p.view(-1) if prod_p is not None else torch.empty(size, dtype=x.dtype, device=x.device)
        sn = prod_n.view(-1) if prod_n is not None else torch.empty_like(sp)
        for start in range(0, x.numel(), BLOCK):
            stop = min(start + BLOCK, x.numel())
            pp = sp[start:stop] if prod_p is not None else sp[: stop - start]
            pn = sn[start:stop] if prod_n is not None else sn[: stop - start]
            _backward_block(flat[0][start:stop], flat[1][start:stop], a_p, a_n, beta, eps, flat[2][start:stop], pp, pn,
                            [t[: stop - start] for t in scratch], zero)
        grad_p = prod_p.sum_to_size(a_p.shape) if ctx.needs_input_grad[1] else None
        grad_n = prod_n.sum_to_size(a_n.shape) if ctx.needs_input_grad[2] else None
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
