"""Rewards for verl: ``compute_score`` for ``reward.custom_reward_function`` and the ``apertus`` reward manager.

The judge-driven stages (SDPO, online DPO) select the reward manager ``none``: reward 0 for every rollout,
since the judge scores them in the trainer step.

verl's reward managers decode responses with ``skip_special_tokens=True``, which deletes the
Apertus tool-call markers (``<|tools_prefix|>`` and ``<|tools_suffix|>`` are special tokens)
and with them the answer tool's call. The ``apertus`` reward manager is verl's naive manager
with a decode that keeps them, so the core output parser sees what the model generated.

Which reward function scores a sample: ``extra_info["reward_fn"]`` if present, else the
``data_source`` when it names a registered function (``math_verify``, ``ifeval``,
``exact_match``), else ``default_reward_fn`` (from ``reward_kwargs``).
"""

from __future__ import annotations

from typing import Any

from apertus_plugins.plugins import registry

__all__ = ["compute_score", "register_reward_manager"]


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  default_reward_fn: str | None = None, **kwargs: Any) -> float:
    """Score one response with a reward function registered through ``apertus_reward_functions``."""
    fns = registry().reward_functions
    extra = dict(extra_info or {})
    name = extra.get("reward_fn") or (data_source if data_source in fns else default_reward_fn)
    if name is None:
        raise ValueError(f"no reward function for data_source {data_source!r}: set extra_info.reward_fn or "
                         f"reward_kwargs.default_reward_fn to one of {', '.join(sorted(fns))}")
    if name not in fns:
        raise KeyError(f"unknown reward function {name!r}; registered: {', '.join(sorted(fns))}")
    opts = {k: v for k, v in extra.items() if k in ("tool_name", "argument", "require_tool", "strict", "casefold")}
    opts.update(kwargs.pop("reward_options", None) or {})
    return float(fns[name](solution_str, ground_truth, **opts))


class _KeepSpecialTokens:
    """A tokenizer view whose ``decode`` keeps special tokens (everything else is delegated)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kw: Any) -> str:
        return self._tok.decode(ids, skip_special_tokens=False, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


_compute_score = compute_score


def register_reward_manager() -> type:
    """Register ``reward.reward_manager.name=apertus`` (and ``none``) with verl (idempotent)."""
    from verl.experimental.reward_loop.reward_manager import NaiveRewardManager, get_reward_manager_cls, register
    from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

    try:
        return get_reward_manager_cls("apertus")
    except ValueError:
        pass

    @register("none")
    class NoRewardManager(RewardManagerBase):
        """Reward 0 for every rollout: the judge-driven stages (SDPO, online DPO) score rollouts in the
        trainer step, and verl's reward loop still runs on every trajectory."""

        def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None, *args: Any, **kw: Any) -> None:
            super().__init__(config, tokenizer, compute_score)

        async def run_single(self, data: Any) -> dict:
            return {"reward_score": 0.0, "reward_extra_info": {}}

    @register("apertus")
    class ApertusRewardManager(NaiveRewardManager):
        """verl's naive reward manager, decoding with special tokens kept, scoring with :func:`compute_score`."""

        def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None, **kw: Any) -> None:
            # verl's load_reward_manager passes config, tokenizer and compute_score by keyword
            super().__init__(config, _KeepSpecialTokens(tokenizer), compute_score or _compute_score, **kw)

    globals()["ApertusRewardManager"] = ApertusRewardManager
    globals()["NoRewardManager"] = NoRewardManager
    return ApertusRewardManager
