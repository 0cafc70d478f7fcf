"""Post-training losses as small pure torch functions (no framework imports).

Conventions: ``B`` sequences, ``T`` response positions, ``V`` vocabulary entries, ``K`` top-k
size, ``N`` flattened tokens, ``H`` hidden size, ``P`` preference pairs. Masks are 0/1 (or
bool) tensors over response positions. Every function is differentiable where a training
loss needs it and returns plain tensors, so each can be tested against a float64 reference
without a trainer.

SDPO (self-distilled policy optimization, SPEC section 6): per response token the student
(the policy under the original prompt) is pulled towards the teacher (the frozen initial
policy scoring the same response with the judge's feedback in the prompt) by a reverse KL
over the student's top-k tokens plus one tail bucket holding the remaining mass::

    S_t      = top-k ids of p_student(. | x, y_<t)             (selection carries no gradient)
    q_i      = p_student(i),  r_i = p_teacher(i)   for i in S_t
    q_tail   = 1 - sum_S q_i, r_tail = 1 - sum_S r_i
    KL_t     = sum_{b in S_t + tail} q_b (log q_b - log r_b)
    w_t      = min(exp(log pi_theta(y_t) - log pi_rollout(y_t)), clip)  (detached)
    loss     = aggregate(w_t * KL_t over the response mask)

DPO: pairs are laid out interleaved, row ``2p`` the chosen and row ``2p + 1`` the rejected
response of pair ``p`` (the layout the verl adapter keeps through batch balancing and
micro-batching). Length-normalized DPO divides each sequence's log-probability (policy and
reference alike) by its own number of response tokens before the standard DPO loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "AGG_MODES",
    "aggregate",
    "clipped_importance_weights",
    "topk_tail_reverse_kl",
    "topk_tail_reverse_kl_from_hidden",
    "sdpo_loss",
    "sequence_logps",
    "split_pairs",
    "dpo_loss",
    "dpo_loss_from_tokens",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum")


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a per-token loss ``(B, T)`` over ``mask`` ``(B, T)`` to a scalar.

    Modes: ``token-mean`` (sum over valid tokens / number of valid tokens), ``token-sum``,
    ``seq-mean-token-mean`` (mean over sequences of each sequence's token mean) and
    ``seq-mean-token-sum``. Fully masked sequences are excluded from sequence means.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"aggregate: loss {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ in shape")
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum().clamp_min(1.0)
    if mode == "token-sum":
        return (loss_mat * m).sum()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        tokens = m.sum(-1)
        seq = (loss_mat * m).sum(-1)
        if mode == "seq-mean-token-mean":
            seq = seq / tokens.clamp_min(1.0)
        valid = (tokens > 0).to(loss_mat.dtype)
        return (seq * valid).sum() / valid.sum().clamp_min(1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; modes are {', '.join(AGG_MODES)}")


def clipped_importance_weights(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                               clip: float | None = 2.0) -> torch.Tensor:
    """Token-level importance ratio ``pi_theta / pi_rollout`` clipped above at ``clip``; detached.

    Shapes: ``(B, T)`` each, returns ``(B, T)``. ``clip=None`` disables the clip.
    """
    log_ratio = (log_probs.detach() - old_log_probs.detach()).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    return ratio if clip is None else ratio.clamp(max=clip)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0`` (the log of a tail mass), floored at the dtype's tiny.

    Each branch of the stable formula sees only inputs from its own range, so neither produces
    an infinite value whose gradient would turn into NaN through ``torch.where``.
    """
    tiny = torch.finfo(x.dtype).tiny
    x = x.clamp(max=0.0)
    near = x.clamp(min=-0.6931471805599453)
    far = x.clamp(max=-0.6931471805599453)
    return torch.where(x > -0.6931471805599453, torch.log((-torch.expm1(near)).clamp_min(tiny)),
                       torch.log1p(-torch.exp(far)))


def _bucket_kl(student_logp_k: torch.Tensor, teacher_logp_k: torch.Tensor) -> torch.Tensor:
    """KL over the K selected ids plus the tail bucket; ``(..., K)`` log-probs -> ``(...)``."""
    s_tail = _log1mexp(torch.logsumexp(student_logp_k, dim=-1, keepdim=True))
    t_tail = _log1mexp(torch.logsumexp(teacher_logp_k, dim=-1, keepdim=True))
    s = torch.cat([student_logp_k, s_tail], dim=-1)
    t = torch.cat([teacher_logp_k, t_tail], dim=-1)
    return (s.exp() * (s - t)).sum(-1)


def topk_tail_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 64,
                         chunk_size: int | None = None) -> torch.Tensor:
    """Per-token reverse KL(student || teacher) over the student's top-``k`` ids plus a tail bucket.

    Args:
        student_logits: ``(..., V)``; gradients flow into it.
        teacher_logits: ``(..., V)``; treated as a constant (detached).
        k: number of student ids kept individually (SPEC: 64); ``k >= V`` gives the full KL.
        chunk_size: process this many tokens at a time (bounds the ``(chunk, V)`` float32 buffers;
            ``None``: all at once).

    Returns:
        ``(...)`` per-token KL in float32 (float64 inputs stay float64).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    lead, vocab = student_logits.shape[:-1], student_logits.shape[-1]
    k = min(int(k), vocab)
    if k < 1:
        raise ValueError(f"top-k size must be at least 1, got {k}")
    s_flat = student_logits.reshape(-1, vocab)
    t_flat = teacher_logits.detach().reshape(-1, vocab)
    n = s_flat.shape[0]
    step = n if not chunk_size else int(chunk_size)
    outs = []
    for a in range(0, max(n, 1), max(step, 1)):
        s = s_flat[a:a + step]
        t = t_flat[a:a + step]
        dtype = torch.float64 if s.dtype == torch.float64 else torch.float32
        s = s.to(dtype)
        s_lse = torch.logsumexp(s, dim=-1, keepdim=True)
        idx = torch.topk(s.detach(), k, dim=-1).indices
        s_k = s.gather(-1, idx) - s_lse
        with torch.no_grad():
            t = t.to(dtype)
            t_k = t.gather(-1, idx) - torch.logsumexp(t, dim=-1, keepdim=True)
        outs.append(_bucket_kl(s_k, t_k))
    return torch.cat(outs).reshape(lead) if outs else s_flat.new_zeros(lead, dtype=torch.float32)


def topk_tail_reverse_kl_from_hidden(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                                     weight: torch.Tensor, k: int = 64, chunk_size: int = 1024,
                                     teacher_weight: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`topk_tail_reverse_kl` from final hidden states and the LM head, never holding full logits.

    Logits are built ``chunk_size`` tokens at a time and, for the backward pass, rebuilt per chunk
    (activation checkpointing), so the peak extra memory is a few ``(chunk_size, V)`` buffers
    whatever the number of tokens.

    Args:
        student_hidden: ``(N, H)`` (gradients flow into it and into ``weight``).
        teacher_hidden: ``(N, H)`` constant.
        weight: ``(V, H)`` LM head of the student.
        teacher_weight: ``(V, H)`` LM head of the teacher (default: ``weight``, detached).

    Returns:
        ``(N,)`` per-token KL.
    """
    from torch.utils.checkpoint import checkpoint

    if student_hidden.shape != teacher_hidden.shape or student_hidden.dim() != 2:
        raise ValueError(f"hidden states must both be (N, H); got {tuple(student_hidden.shape)} and "
                         f"{tuple(teacher_hidden.shape)}")
    t_weight = (weight if teacher_weight is None else teacher_weight).detach()

    def chunk_kl(h_s: torch.Tensor, h_t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s_logits = h_s @ w.t()
        with torch.no_grad():
            t_logits = h_t @ t_weight.t()
        return topk_tail_reverse_kl(s_logits, t_logits, k=k)

    outs = []
    for a in range(0, student_hidden.shape[0], chunk_size):
        h_s = student_hidden[a:a + chunk_size]
        h_t = teacher_hidden[a:a + chunk_size].detach()
        if torch.is_grad_enabled() and (h_s.requires_grad or weight.requires_grad):
            outs.append(checkpoint(chunk_kl, h_s, h_t, weight, use_reentrant=False))
        else:
            outs.append(chunk_kl(h_s, h_t, weight))
    return torch.cat(outs) if outs else student_hidden.new_zeros(0)


def sdpo_loss(per_token_kl: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
              response_mask: torch.Tensor, is_clip: float | None = 2.0,
              loss_agg_mode: str = "token-mean",
              agg: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The SDPO objective from per-token KLs.

    Args:
        per_token_kl: ``(B, T)`` from :func:`topk_tail_reverse_kl` (carries the gradient).
        log_probs: ``(B, T)`` current-policy log-probs of the sampled tokens.
        old_log_probs: ``(B, T)`` rollout-policy log-probs of the same tokens.
        response_mask: ``(B, T)``.
        is_clip: upper clip of the token-level importance ratio (SPEC: 2); ``None`` disables it.
        loss_agg_mode: see :func:`aggregate`; ``agg(loss_mat, mask)`` overrides it (a framework's
            global-batch aggregation).

    Returns:
        ``(loss, metrics)``; metrics hold detached scalars (``kl``, ``is_ratio_mean``,
        ``is_clip_frac``).
    """
    w = clipped_importance_weights(log_probs, old_log_probs, clip=None)
    clipped = w if is_clip is None else w.clamp(max=is_clip)
    loss_mat = clipped * per_token_kl
    loss = agg(loss_mat, response_mask) if agg is not None else aggregate(loss_mat, response_mask, loss_agg_mode)
    with torch.no_grad():
        m = response_mask.to(torch.float32)
        denom = m.sum().clamp_min(1.0)
        metrics = {
            "kl": (per_token_kl.detach().float() * m).sum() / denom,
            "is_ratio_mean": (w.float() * m).sum() / denom,
            "is_clip_frac": (((w > is_clip) if is_clip is not None else torch.zeros_like(m, dtype=torch.bool))
                             .float() * m).sum() / denom,
        }
    return loss, metrics


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, length_normalize: bool = False) -> torch.Tensor:
    """Sum (or mean, with ``length_normalize``) of token log-probs per sequence; ``(B, T)`` -> ``(B,)``."""
    m = mask.to(token_logps.dtype)
    total = (token_logps * m).sum(-1)
    if length_normalize:
        lengths = m.sum(-1)
        if bool((lengths == 0).any()):
            raise ValueError("length-normalized log-probability of a sequence without response tokens")
        total = total / lengths
    return total


def split_pairs(x: torch.Tensor, pair_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split interleaved rows ``(2P, ...)`` into chosen ``(P, ...)`` and rejected ``(P, ...)``.

    With ``pair_ids`` ``(2P,)``, check that rows ``2p`` and ``2p + 1`` belong to the same pair
    (a broken pair is an error, never a silently wrong loss).
    """
    if x.shape[0] % 2:
        raise ValueError(f"interleaved preference rows must come in pairs; got {x.shape[0]} rows")
    if pair_ids is not None:
        pid = pair_ids.reshape(-1)
        if pid.shape[0] != x.shape[0] or not bool((pid[0::2] == pid[1::2]).all()):
            bad = (pid[0::2] != pid[1::2]).nonzero().flatten().tolist()[:5] if pid.shape[0] == x.shape[0] else "?"
            raise ValueError(f"preference pairs were separated: rows 2p and 2p+1 have different pair ids "
                             f"(first broken pairs: {bad})")
    return x[0::2], x[1::2]


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float = 0.1,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DPO loss per pair.

    ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``; all inputs ``(P,)`` sequence
    log-probabilities. Returns ``(losses (P,), chosen_rewards (P,), rejected_rewards (P,))``,
    rewards being ``beta * (pi - ref)`` (detached).
    """
    chosen = policy_chosen_logps - ref_chosen_logps.detach()
    rejected = policy_rejected_logps - ref_rejected_logps.detach()
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return losses, (beta * chosen).detach(), (beta * rejected).detach()


def dpo_loss_from_tokens(policy_token_logps: torch.Tensor, ref_token_logps: torch.Tensor,
                         response_mask: torch.Tensor, beta: float = 0.1, length_normalize: bool = False,
                         pair_ids: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (or length-normalized DPO) from interleaved token log-probs.

    Args:
        policy_token_logps: ``(2P, T)`` policy log-probs of the response tokens.
        ref_token_logps: ``(2P, T)`` reference log-probs (constant).
        response_mask: ``(2P, T)``.
        beta: DPO temperature (online: 0.1; offline length-normalized: 25 in SPEC).
        length_normalize: divide each sequence's log-probability by its own length.
        pair_ids: ``(2P,)`` to check pair integrity.

    Returns:
        ``(losses (P,), metrics)``; metrics: ``chosen_rewards``, ``rejected_rewards``,
        ``reward_accuracy``, ``reward_margin`` (detached means).
    """
    pol = sequence_logps(policy_token_logps, response_mask, length_normalize)
    ref = sequence_logps(ref_token_logps.detach(), response_mask, length_normalize)
    pc, pr = split_pairs(pol, pair_ids)
    rc, rr = split_pairs(ref, pair_ids)
    losses, cr, rj = dpo_loss(pc, pr, rc, rr, beta)
    metrics = {
        "chosen_rewards": cr.mean(),
        "rejected_rewards": rj.mean(),
        "reward_accuracy": (cr > rj).float().mean(),
        "reward_margin": (cr - rj).mean(),
    }
    return losses, metrics
