"""AdEMAMix against a reference written from the paper (Algorithm 1 and its warmup schedulers), in float64.

Also: the schedulers' end points, checkpointing through ``state_dict`` (an interrupted run resumes
bit for bit), the keyword arguments megatron-core passes to its ``Adam``, and the settings the
adapter refuses.
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_patches.ademamix import RECIPE, AdEMAMix, alpha_at, beta3_at


def paper_reference(theta0: list[np.ndarray], grads: list[list[np.ndarray]], *, lr: float, b1: float, b2: float,
                    b3: float, alpha: float, eps: float, wd: float, t_alpha: int | None,
                    t_beta3: int | None) -> list[np.ndarray]:
    """Algorithm 1 of Pagliardini, Ablin & Grangier (2024), one parameter tensor at a time."""
    out = []
    for k, theta in enumerate(theta0):
        theta = theta.astype(np.float64).copy()
        m1 = np.zeros_like(theta)
        m2 = np.zeros_like(theta)
        nu = np.zeros_like(theta)
        for t, g_all in enumerate(grads, start=1):
            g = g_all[k].astype(np.float64)
            a_t = min(t * alpha / t_alpha, alpha) if t_alpha else alpha
            if t_beta3:
                ls, le = math.log(b1), math.log(b3)
                b3_t = min(math.exp(ls * le / ((1 - t / t_beta3) * le + (t / t_beta3) * ls)), b3)
            else:
                b3_t = b3
            m1 = b1 * m1 + (1 - b1) * g
            m2 = b3_t * m2 + (1 - b3_t) * g
            nu = b2 * nu + (1 - b2) * g * g
            m1_hat = m1 / (1 - b1**t)
            nu_hat = nu / (1 - b2**t)
            theta = theta - lr * ((m1_hat + a_t * m2) / (np.sqrt(nu_hat) + eps) + wd * theta)
        out.append(theta)
    return out


@pytest.mark.parametrize("warmup", [None, 12])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_the_paper(warmup: int | None, wd: float) -> None:
    rng = np.random.default_rng(0)
    shapes = [(7, 5), (5,), (1,)]
    theta0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(30)]
    hp = {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "b3": 0.99, "alpha": 5.0, "eps": 1e-8, "wd": wd}
    params = [torch.nn.Parameter(torch.from_numpy(t.copy())) for t in theta0]
    opt = AdEMAMix(params, lr=hp["lr"], betas=(hp["b1"], hp["b2"], hp["b3"]), alpha=hp["alpha"], eps=hp["eps"],
                   weight_decay=wd, alpha_warmup=warmup, beta3_warmup=warmup)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
    want = paper_reference(theta0, grads, **hp, t_alpha=warmup, t_beta3=warmup)
    for p, w in zip(params, want, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=2e-5, atol=2e-6)
    assert all(opt.state[p]["step"] == 30 for p in params)


def test_l2_weight_decay_mode() -> None:
    """``decoupled_weight_decay=False`` is Adam-style L2: the decay enters the gradient (and the moments)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    q = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    a = AdEMAMix([p], lr=0.1, weight_decay=0.5, decoupled_weight_decay=False)
    b = AdEMAMix([q], lr=0.1, weight_decay=0.0)
    p.grad = torch.tensor([0.3, 0.3])
    q.grad = torch.tensor([0.3, 0.3]) + 0.5 * q.detach()
    a.step()
    b.step()
    assert torch.allclose(p, q)


def test_schedulers() -> None:
    assert alpha_at(0, 8.0, 100) == 0.0 and alpha_at(50, 8.0, 100) == 4.0 and alpha_at(500, 8.0, 100) == 8.0
    assert alpha_at(3, 8.0, None) == 8.0
    assert beta3_at(0, 0.9999, 0.9, 100) == pytest.approx(0.9)
    assert beta3_at(100, 0.9999, 0.9, 100) == pytest.approx(0.9999)
    assert beta3_at(10**6, 0.9999, 0.9, 100) == 0.9999
    # the half-life moves linearly: halfway in steps is halfway in half-life
    half = [-math.log(2) / math.log(b) for b in (0.9, beta3_at(50, 0.9999, 0.9, 100), 0.9999)]
    assert half[1] == pytest.approx((half[0] + half[2]) / 2, rel=1e-9)
    values = [beta3_at(t, 0.9999, 0.9, 100) for t in range(0, 101, 5)]
    assert all(x < y for x, y in zip(values, values[1:], strict=False))
    assert RECIPE["betas"] == (0.9, 0.999, 0.9999) and RECIPE["alpha"] == 8.0 and RECIPE["alpha_warmup"] == 100_000


def test_checkpoint_resume_is_exact() -> None:
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 3, generator=g) for _ in range(10)]

    def run(steps: range, p: torch.nn.Parameter, opt: AdEMAMix) -> None:
        for i in steps:
            p.grad = grads[i].clone()
            opt.step()

    kw = {"lr": 0.05, "alpha": 8.0, "alpha_warmup": 6, "beta3_warmup": 6, "weight_decay": 0.1}
    straight = torch.nn.Parameter(torch.ones(4, 3))
    opt = AdEMAMix([straight], **kw)
    run(range(10), straight, opt)
    first = torch.nn.Parameter(torch.ones(4, 3))
    opt1 = AdEMAMix([first], **kw)
    run(range(5), first, opt1)
    saved = {"param": first.detach().clone(), "opt": opt1.state_dict()}
    resumed = torch.nn.Parameter(saved["param"].clone())
    opt2 = AdEMAMix([resumed], **kw)
    opt2.load_state_dict(saved["opt"])
    assert set(opt2.state[resumed]) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_slow"}
    run(range(5, 10), resumed, opt2)
    assert torch.equal(resumed, straight)


def test_megatron_core_construction() -> None:
    """megatron-core builds ``Adam(params=..., lr, weight_decay, betas, eps, adam_w_mode)``: inside the
    adapter's block that is AdEMAMix with beta3, alpha and the warmups of the --apertus-ademamix flags."""
    import megatron.core.optimizer as mco

    from megatron_patches.arguments import add_apertus_args, options_from_args
    from megatron_patches.optimizer import MegatronAdEMAMix, ademamix_init_state_fn, check_ademamix_config
    from megatron_patches.overrides import adam_replaced_by_ademamix

    opts = options_from_args(add_apertus_args(argparse.ArgumentParser()).parse_args(
        ["--apertus-optimizer", "ademamix", "--apertus-ademamix-alpha", "5", "--apertus-ademamix-beta3-warmup", "7"]))
    before = mco.Adam
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    with adam_replaced_by_ademamix(opts.ademamix):
        assert mco.USING_PYTORCH_OPTIMIZER is False
        opt = mco.Adam(params=[{"params": params, "wd_mult": 1.0}], lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                       eps=1e-8, adam_w_mode=True)
    assert mco.Adam is before
    assert isinstance(opt, MegatronAdEMAMix)
    d = opt.defaults
    assert d["betas"] == (0.9, 0.95, 0.9999) and d["alpha"] == 5.0 and d["beta3_warmup"] == 7
    assert d["alpha_warmup"] == 100_000 and d["decoupled_weight_decay"] is True
    ademamix_init_state_fn(opt)  # megatron-core's checkpoint-loading template
    assert all(set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_slow"} for p in params)
    base = {"optimizer": "adam", "use_distributed_optimizer": False, "optimizer_cpu_offload": False,
            "use_precision_aware_optimizer": False}
    check_ademamix_config(SimpleNamespace(**base))
    with pytest.raises(ValueError, match="DistributedOptimizer checkpoints only Adam's two moments"):
        check_ademamix_config(SimpleNamespace(**{**base, "use_distributed_optimizer": True}))
    with pytest.raises(ValueError, match="pass --optimizer adam"):
        check_ademamix_config(SimpleNamespace(**{**base, "optimizer": "sgd"}))
    with pytest.raises(ValueError, match="precision-aware"):
        MegatronAdEMAMix(params, exp_avg_dtype=torch.bfloat16)


def test_megatron_checkpoint_carries_the_slow_ema() -> None:
    """megatron-core's optimizer-state sharding (used by its FP32/Float16 optimizer checkpoints) keeps every
    AdEMAMix state tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import optim_state_to_sharding_state

    p = torch.nn.Parameter(torch.zeros(4))
    opt = AdEMAMix([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    state = opt.state_dict()
    sharded = {0: ShardedTensor.from_rank_offsets("decoder.w", p.detach(), replica_id=0)}
    optim_state_to_sharding_state(state, sharded, exclude_keys=("step",))
    keys = {v.key for v in state["state"][0].values() if hasattr(v, "key")}
    assert keys == {"optimizer.state.exp_avg.decoder.w", "optimizer.state.exp_avg_sq.decoder.w",
                    "optimizer.state.exp_avg_slow.decoder.w"}
