"""The post-training losses against float64 references written from the formulas, with gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from apertus_plugins.core import losses as L

torch.manual_seed(0)


# ---------------------------------------------------------------- float64 references (plain loops)
def ref_topk_tail_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per token: softmax both, student top-k ids, k buckets plus the tail, sum q log(q/r)."""
    s = student_logits.double().reshape(-1, student_logits.shape[-1])
    t = teacher_logits.double().reshape(-1, teacher_logits.shape[-1])
    out = []
    for i in range(s.shape[0]):
        q = torch.softmax(s[i], -1)
        r = torch.softmax(t[i], -1)
        ids = sorted(range(len(q)), key=lambda j: -float(q[j].detach()))[:k]
        qk = q[ids]
        rk = r[ids]
        qt = 1 - qk.sum()
        rt = 1 - rk.sum()
        kl = sum(qk[j] * (torch.log(qk[j]) - torch.log(rk[j])) for j in range(len(ids)))
        if qt > 0:
            kl = kl + qt * (torch.log(qt) - torch.log(rt))
        out.append(kl)
    return torch.stack(out).reshape(student_logits.shape[:-1])


def ref_full_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    q = torch.softmax(student_logits.double(), -1)
    r = torch.softmax(teacher_logits.double(), -1)
    return (q * (q.log() - r.log())).sum(-1)


def ref_dpo(pc, pr, rc, rr, beta):
    return torch.stack([-torch.log(1 / (1 + torch.exp(-beta * ((a - c) - (b - d)))))
                        for a, b, c, d in zip(pc, pr, rc, rr, strict=True)])


# ---------------------------------------------------------------- SDPO
@pytest.mark.parametrize("k", [1, 4, 16])
def test_topk_tail_kl_matches_reference(k):
    s = torch.randn(3, 5, 40, dtype=torch.float64) * 3
    t = torch.randn(3, 5, 40, dtype=torch.float64) * 3
    got = L.topk_tail_reverse_kl(s, t, k=k)
    assert got.shape == (3, 5) and got.dtype == torch.float64
    torch.testing.assert_close(got, ref_topk_tail_kl(s, t, k), rtol=1e-10, atol=1e-12)
    assert bool((got >= -1e-12).all())  # a KL between two (k+1)-bucket distributions


def test_topk_tail_kl_float32_chunked_and_full_vocab():
    s = torch.randn(50, 64) * 4
    t = torch.randn(50, 64) * 4
    whole = L.topk_tail_reverse_kl(s, t, k=8)
    chunked = L.topk_tail_reverse_kl(s, t, k=8, chunk_size=7)
    torch.testing.assert_close(whole, chunked)
    torch.testing.assert_close(whole.double(), ref_topk_tail_kl(s, t, 8), rtol=1e-4, atol=1e-5)
    # k = V: the tail is empty and the value is the full reverse KL
    torch.testing.assert_close(L.topk_tail_reverse_kl(s.double(), t.double(), k=64), ref_full_reverse_kl(s, t),
                               rtol=1e-9, atol=1e-10)


def test_topk_tail_kl_is_zero_for_identical_distributions_and_teacher_gets_no_grad():
    s = torch.randn(4, 30, requires_grad=True)
    t = s.detach().clone().requires_grad_(True)
    kl = L.topk_tail_reverse_kl(s, t, k=5)
    torch.testing.assert_close(kl, torch.zeros(4), atol=1e-6, rtol=0)
    kl.sum().backward()
    assert t.grad is None


def test_topk_tail_kl_gradcheck():
    s = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 3, 12, dtype=torch.float64)
    # the top-k selection is piecewise constant; small perturbations keep it (no near-ties here)
    assert torch.autograd.gradcheck(lambda x: L.topk_tail_reverse_kl(x, t, k=4), (s,), eps=1e-6, atol=1e-7)


def test_topk_tail_kl_gradient_matches_reference_gradient():
    s = torch.randn(6, 20, dtype=torch.float64, requires_grad=True)
    t = torch.randn(6, 20, dtype=torch.float64)
    g, = torch.autograd.grad(L.topk_tail_reverse_kl(s, t, k=5).sum(), s)
    s2 = s.detach().clone().requires_grad_(True)
    g_ref, = torch.autograd.grad(ref_topk_tail_kl(s2, t, 5).sum(), s2)
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-11)


def test_from_hidden_matches_from_logits_values_and_gradients():
    n, h, v = 37, 16, 300
    hs = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(n, h, dtype=torch.float64)
    w = (torch.randn(v, h, dtype=torch.float64) * 0.5).requires_grad_(True)
    got = L.topk_tail_reverse_kl_from_hidden(hs, ht, w, k=8, chunk_size=10)
    want = L.topk_tail_reverse_kl(hs @ w.t(), ht @ w.detach().t(), k=8)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    g_h, g_w = torch.autograd.grad(got.sum(), (hs, w))
    r_h, r_w = torch.autograd.grad(want.sum(), (hs, w))
    torch.testing.assert_close(g_h, r_h, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(g_w, r_w, rtol=1e-9, atol=1e-11)


def test_sdpo_loss_importance_clip_and_aggregation():
    b, t = 3, 6
    kl = torch.rand(b, t, dtype=torch.float64, requires_grad=True)
    logp = torch.log(torch.rand(b, t, dtype=torch.float64))
    old = torch.log(torch.rand(b, t, dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    loss, metrics = L.sdpo_loss(kl, logp, old, mask, is_clip=2.0)
    ratio = [[min(math.exp(float(logp[i, j] - old[i, j])), 2.0) for j in range(t)] for i in range(b)]
    num = sum(ratio[i][j] * float(kl[i, j]) for i in range(b) for j in range(t) if mask[i, j])
    assert float(loss) == pytest.approx(num / float(mask.sum()), rel=1e-12)
    # the ratio is a detached weight: d loss / d kl = clipped ratio / #tokens on valid tokens, 0 elsewhere
    g, = torch.autograd.grad(loss, kl)
    want = torch.tensor(ratio, dtype=torch.float64) * mask / mask.sum()
    torch.testing.assert_close(g, want)
    frac = sum(1 for i in range(b) for j in range(t)
               if mask[i, j] and math.exp(float(logp[i, j] - old[i, j])) > 2) / float(mask.sum())
    assert float(metrics["is_clip_frac"]) == pytest.approx(frac)
    seq, _ = L.sdpo_loss(kl, logp, old, mask, is_clip=2.0, loss_agg_mode="seq-mean-token-mean")
    per_seq = [sum(ratio[i][j] * float(kl[i, j]) for j in range(t) if mask[i, j]) / float(mask[i].sum())
               for i in range(b)]
    assert float(seq) == pytest.approx(sum(per_seq) / b, rel=1e-12)


def test_aggregate_rejects_unknown_mode_and_shape_mismatch():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        L.aggregate(torch.ones(2, 2), torch.ones(2, 2), "mean")
    with pytest.raises(ValueError, match="differ in shape"):
        L.aggregate(torch.ones(2, 2), torch.ones(2, 3))


# ---------------------------------------------------------------- DPO
def _pairs(p=4, t=7):
    pol = torch.log(torch.rand(2 * p, t, dtype=torch.float64)).requires_grad_(True)
    ref = torch.log(torch.rand(2 * p, t, dtype=torch.float64))
    lengths = torch.randint(1, t + 1, (2 * p,))
    mask = (torch.arange(t)[None] < lengths[:, None]).to(torch.float64)
    return pol, ref, mask


@pytest.mark.parametrize("length_normalize,beta", [(False, 0.1), (True, 25.0)])
def test_dpo_from_tokens_matches_reference(length_normalize, beta):
    pol, ref, mask = _pairs()

    def seq(x, i):
        s = sum(float(x[i, j]) for j in range(x.shape[1]) if mask[i, j])
        return s / float(mask[i].sum()) if length_normalize else s

    p = pol.shape[0] // 2
    pc = torch.tensor([seq(pol, 2 * i) for i in range(p)], dtype=torch.float64)
    pr = torch.tensor([seq(pol, 2 * i + 1) for i in range(p)], dtype=torch.float64)
    rc = torch.tensor([seq(ref, 2 * i) for i in range(p)], dtype=torch.float64)
    rr = torch.tensor([seq(ref, 2 * i + 1) for i in range(p)], dtype=torch.float64)
    losses, metrics = L.dpo_loss_from_tokens(pol, ref, mask, beta=beta, length_normalize=length_normalize,
                                             pair_ids=torch.arange(p).repeat_interleave(2))
    torch.testing.assert_close(losses, ref_dpo(pc, pr, rc, rr, beta), rtol=1e-10, atol=1e-12)
    margin = beta * ((pc - rc) - (pr - rr))
    assert float(metrics["reward_margin"]) == pytest.approx(float(margin.mean()), rel=1e-10)
    assert float(metrics["reward_accuracy"]) == pytest.approx(float((margin > 0).double().mean()))


@pytest.mark.parametrize("length_normalize", [False, True])
def test_dpo_gradcheck(length_normalize):
    pol, ref, mask = _pairs(p=2, t=4)
    assert torch.autograd.gradcheck(
        lambda x: L.dpo_loss_from_tokens(x, ref, mask, beta=0.7, length_normalize=length_normalize)[0],
        (pol,), eps=1e-6, atol=1e-8)


def test_dpo_gradient_formula():
    # d/d(pi_c) of -log sigmoid(beta*m) = -beta * sigmoid(-beta*m)
    pc = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    pr, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in (-0.2, 0.1, 0.4))
    loss, _, _ = L.dpo_loss(pc, pr, rc, rr, beta=2.0)
    g, = torch.autograd.grad(loss.sum(), pc)
    m = (0.3 - 0.1) - (-0.2 - 0.4)
    assert float(g) == pytest.approx(-2.0 / (1 + math.exp(2.0 * m)), rel=1e-12)


def test_broken_pairs_are_an_error():
    pol, ref, mask = _pairs(p=3)
    ids = torch.tensor([0, 0, 1, 2, 1, 2])
    with pytest.raises(ValueError, match="pairs were separated"):
        L.dpo_loss_from_tokens(pol, ref, mask, pair_ids=ids)
    with pytest.raises(ValueError, match="come in pairs"):
        L.split_pairs(torch.zeros(5))
    with pytest.raises(ValueError, match="without response tokens"):
        L.sequence_logps(torch.zeros(2, 3), torch.zeros(2, 3), length_normalize=True)
