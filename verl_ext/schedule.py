"""The linear learning-rate schedule of the DPO stages (SPEC section 6), installed into verl's FSDP engine.

verl 0.9's FSDP engine builds its scheduler in ``FSDPEngine._build_lr_scheduler`` from a fixed choice
(``constant`` or ``cosine``; ``FSDPOptimizerConfig`` rejects any other ``lr_scheduler_type``), and
offers no registry or hook for another one. What it does let a plugin change is the worker class
(the trainers run :class:`verl_ext.trainers.ApertusActorRolloutRefWorker`), so the worker replaces
the engine's scheduler once the engine is built: :func:`install_lr_schedule` wraps the same
optimizer in a :class:`torch.optim.lr_scheduler.LambdaLR` with :class:`LinearWarmupDecay`, carries
over the step count (a resumed run continues where it stopped) and hands the new scheduler to the
engine's checkpoint manager, so checkpoints save and restore it. Warmup and horizon are verl's own
settings: ``optim.lr_warmup_steps`` (or ``lr_warmup_steps_ratio`` of ``total_training_steps``) and
``optim.min_lr_ratio``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEDULES", "LinearWarmupDecay", "install_lr_schedule", "warmup_steps"]

#: schedules :func:`install_lr_schedule` knows besides verl's own (``verl`` keeps the engine's)
SCHEDULES = ("verl", "linear")


@dataclass
class LinearWarmupDecay:
    """LR multiplier: linear from 0 to 1 over ``warmup`` steps, then linear to ``min_ratio`` at ``total``.

    Step ``s`` counts from 0 (the first optimizer update uses ``s = 0``), as verl's schedules do.
    """

    warmup: int
    total: int
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ValueError(f"the linear schedule needs the total number of training steps; got {self.total}")
        if not 0 <= self.warmup <= self.total:
            raise ValueError(f"warmup of {self.warmup} steps does not fit {self.total} training steps")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be within [0, 1], got {self.min_ratio}")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return max(self.min_ratio, 1.0 - (1.0 - self.min_ratio) * progress)


def warmup_steps(optim_config: Any) -> int:
    """verl's warmup rule: ``lr_warmup_steps`` when positive, else ``lr_warmup_steps_ratio * total``."""
    steps = getattr(optim_config, "lr_warmup_steps", None)
    if steps is not None and steps > 0:
        return int(steps)
    return int(float(getattr(optim_config, "lr_warmup_steps_ratio", 0.0)) * int(optim_config.total_training_steps))


def install_lr_schedule(engine: Any, kind: str, optim_config: Any | None = None) -> Any:
    """Replace ``engine.lr_scheduler`` by the schedule ``kind`` (``"linear"``; ``"verl"`` keeps verl's).

    ``engine`` is verl's training engine (``optimizer``, ``lr_scheduler``, ``checkpoint_manager``,
    ``optimizer_config``). The new scheduler continues at the old one's step, and the optimizer's
    learning rates are set to the new schedule's value at that step. Returns the scheduler in use.
    """
    from torch.optim.lr_scheduler import LambdaLR, LRScheduler

    if kind not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; known: {', '.join(SCHEDULES)}")
    old = getattr(engine, "lr_scheduler", None)
    if kind == "verl":
        return old
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or old is None:
        raise RuntimeError("the engine has no optimizer or scheduler to replace (a forward-only engine?)")
    if not isinstance(old, LRScheduler):
        raise RuntimeError(f"the {type(engine).__name__} schedules with {type(old).__name__}, not a torch scheduler; "
                           "with the megatron strategy use verl's own actor_rollout_ref.actor.optim."
                           "lr_decay_style=linear and leave the apertus lr_schedule at 'verl'")
    cfg = optim_config if optim_config is not None else engine.optimizer_config
    min_ratio = getattr(cfg, "min_lr_ratio", None)
    fn = LinearWarmupDecay(warmup=warmup_steps(cfg), total=int(cfg.total_training_steps),
                           min_ratio=0.0 if min_ratio is None else float(min_ratio))
    for group in optimizer.param_groups:  # the peak LR: what verl's scheduler scales from
        group.setdefault("initial_lr", group["lr"])
    new = LambdaLR(optimizer, fn)
    new.last_epoch = old.last_epoch
    new._step_count = getattr(old, "_step_count", new._step_count)
    lrs = [base * fn(new.last_epoch) for base in new.base_lrs]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    new._last_lr = lrs
    engine.lr_scheduler = new
    manager = getattr(engine, "checkpoint_manager", None)
    if manager is not None and hasattr(manager, "lr_scheduler"):
        manager.lr_scheduler = new
    return new
