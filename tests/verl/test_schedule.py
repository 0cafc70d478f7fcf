"""The DPO stages' linear learning-rate schedule and its installation into an engine shaped like verl's FSDP engine.

The engine here carries verl's real pieces: its optimizer config dataclass (``FSDPOptimizerConfig``),
the scheduler verl's FSDP engine builds (``FSDPEngine._build_lr_scheduler``, called on this object),
a torch AdamW over a small module, and verl's ``FSDPCheckpointManager`` (in a one-process gloo group,
as verl's checkpoint managers read the rank and world size).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from verl.utils.torch_functional import get_constant_schedule_with_warmup
from verl.workers.config import FSDPOptimizerConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

from apertus_plugins.testing.serve import free_port
from verl_ext.schedule import SCHEDULES, LinearWarmupDecay, install_lr_schedule, warmup_steps


def test_linear_warmup_decay_values():
    f = LinearWarmupDecay(warmup=10, total=110)
    assert [f(s) for s in (0, 1, 5, 9)] == pytest.approx([0.0, 0.1, 0.5, 0.9])
    assert f(10) == 1.0  # the peak right after warmup
    assert f(60) == pytest.approx(0.5) and f(109) == pytest.approx(0.01)
    assert f(110) == 0.0 and f(200) == 0.0  # past the horizon it stays at the floor
    g = LinearWarmupDecay(warmup=0, total=4, min_ratio=0.2)
    assert [g(s) for s in range(6)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    # the warmup ramp counts steps as verl's own warmup schedules do (step 0 is the first update)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    verl_lambda = get_constant_schedule_with_warmup(opt, num_warmup_steps=10).lr_lambdas[0]
    assert [f(s) for s in range(11)] == pytest.approx([verl_lambda(s) for s in range(11)])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"warmup": 0, "total": 0}, "needs the total number of training steps; got 0"),
    ({"warmup": 11, "total": 10}, "warmup of 11 steps does not fit 10 training steps"),
    ({"warmup": -1, "total": 10}, "warmup of -1 steps"),
    ({"warmup": 1, "total": 10, "min_ratio": 1.5}, r"min_lr_ratio must be within \[0, 1\], got 1.5"),
])
def test_linear_warmup_decay_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinearWarmupDecay(**kwargs)


def test_warmup_steps_follows_verls_rule():
    cfg = FSDPOptimizerConfig(lr=1e-6, lr_warmup_steps_ratio=0.1, total_training_steps=1921)
    assert cfg.lr_warmup_steps == -1 and warmup_steps(cfg) == 192  # ratio of the horizon, rounded down
    cfg = FSDPOptimizerConfig(lr=1e-7, lr_warmup_steps=10, lr_warmup_steps_ratio=0.5, total_training_steps=100)
    assert warmup_steps(cfg) == 10  # explicit steps win over the ratio
    cfg = FSDPOptimizerConfig(lr=1e-7, lr_warmup_steps=0, lr_warmup_steps_ratio=0.25, total_training_steps=8)
    assert warmup_steps(cfg) == 2  # zero steps, like -1, falls back to the ratio (as verl's engine does)


@pytest.fixture()
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _engine(total: int, ratio: float = 0.1, min_lr_ratio: float | None = 0.0, lr: float = 1e-3):
    """An object with the attributes verl's FSDP engine has after building its optimizer."""
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 2)
    cfg = FSDPOptimizerConfig(lr=lr, lr_warmup_steps_ratio=ratio, total_training_steps=total,
                              min_lr_ratio=min_lr_ratio, weight_decay=0.0, lr_scheduler_type="constant")
    engine = SimpleNamespace(module=module, optimizer_config=cfg, rank=0)
    engine.optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    engine.lr_scheduler = FSDPEngine._build_lr_scheduler(engine, engine.optimizer)  # verl's own scheduler
    engine.checkpoint_manager = FSDPCheckpointManager(model=module, optimizer=engine.optimizer,
                                                      lr_scheduler=engine.lr_scheduler)
    return engine


def _train_steps(engine, n: int) -> list[float]:
    """n optimizer updates as verl's engine does them (step, then scheduler step); the LR each used."""
    used = []
    for _ in range(n):
        engine.optimizer.zero_grad()
        engine.module(torch.ones(1, 4)).sum().backward()
        used.append(engine.optimizer.param_groups[0]["lr"])
        engine.optimizer.step()
        engine.lr_scheduler.step()
    return used


def test_install_linear_schedule_on_a_fresh_engine(one_process_group):
    engine = _engine(total=20, ratio=0.1)
    verls = engine.lr_scheduler
    new = install_lr_schedule(engine, "linear")
    assert new is engine.lr_scheduler and new is not verls
    assert isinstance(new, torch.optim.lr_scheduler.LambdaLR)
    assert engine.checkpoint_manager.lr_scheduler is new  # checkpoints save and restore the new one
    assert new.optimizer is engine.optimizer and new.last_epoch == 0
    used = _train_steps(engine, 20)
    want = [1e-3 * LinearWarmupDecay(warmup=2, total=20)(s) for s in range(20)]
    assert used == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert used[:3] == pytest.approx([0.0, 5e-4, 1e-3]) and used[-1] == pytest.approx(1e-3 / 18)
    # verl's constant schedule would have held the peak after warmup
    assert all(b < a for a, b in zip(used[2:], used[3:], strict=False))


def test_install_carries_the_step_count_over(one_process_group):
    engine = _engine(total=10, ratio=0.2, min_lr_ratio=0.1)
    _train_steps(engine, 4)  # verl's constant schedule ran 4 updates (e.g. restored from a checkpoint)
    assert engine.lr_scheduler.last_epoch == 4 and engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    new = install_lr_schedule(engine, "linear")
    fn = LinearWarmupDecay(warmup=2, total=10, min_ratio=0.1)
    assert new.last_epoch == 4
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * fn(4))  # the LR is set at once
    assert new.get_last_lr() == pytest.approx([1e-3 * fn(4)])
    assert new.base_lrs == [pytest.approx(1e-3)]  # scaled from the peak, not from the warmed-down LR
    used = _train_steps(engine, 6)
    assert used == pytest.approx([1e-3 * fn(s) for s in range(4, 10)])
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)  # the floor at the horizon

    # resume: verl loads the saved state into its own scheduler, then the worker installs again
    saved = new.state_dict()
    resumed = _engine(total=10, ratio=0.2, min_lr_ratio=0.1)
    resumed.lr_scheduler.load_state_dict(saved)
    again = install_lr_schedule(resumed, "linear")
    assert again.last_epoch == 10 and resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_verl_keeps_the_engines_schedule_and_unknown_kinds_fail(one_process_group):
    engine = _engine(total=10)
    verls = engine.lr_scheduler
    assert install_lr_schedule(engine, "verl") is verls and engine.checkpoint_manager.lr_scheduler is verls
    assert SCHEDULES == ("verl", "linear")
    with pytest.raises(ValueError, match=r"unknown learning-rate schedule 'cosine'; known: verl, linear"):
        install_lr_schedule(engine, "cosine")
    assert engine.lr_scheduler is verls
    # a forward-only engine (verl's reference model) has nothing to replace
    with pytest.raises(RuntimeError, match="no optimizer or scheduler"):
        install_lr_schedule(SimpleNamespace(optimizer=None, lr_scheduler=None), "linear")
    # a scheduler that is not torch's (Megatron's) is refused with the way out
    odd = SimpleNamespace(optimizer=engine.optimizer, lr_scheduler=object(), optimizer_config=engine.optimizer_config)
    with pytest.raises(RuntimeError, match="optim.lr_decay_style=linear"):
        install_lr_schedule(odd, "linear")
    # the horizon must be known (verl fills total_training_steps at run time)
    engine.optimizer_config.total_training_steps = -1
    with pytest.raises(ValueError, match="total number of training steps; got -1"):
        install_lr_schedule(engine, "linear")
