"""Rewards for verl: ``compute_score`` for ``reward.custom_reward_function`` and the ``apertus`` reward manager.

The judge-driven stages (SDPO, online DPO) select the reward manager ``none``: reward 0 for every rollout,
since the judge scores them in the trainer step.

verl's reward managers decode responses with ``skip_special_tokens=True``, which deletes the
Apertus tool-call markers (``<|tools_prefix|>`` and ``<|tools_suffix|>`` are special tokens)
and with them the answer tool's call. The ``apertus`` reward manager is verl's naive manager
with a decode that keeps them, so the core output parser sees what the model generated.

Which reward function scores a sample: ``extra_info["reward_fn"]`` if present, else the
``data_source`` when it names a registered function (``math_verify``, ``ifeval``,
``exact_match``, ``code``) or is one of verl's code data sources (:data:`CODE_DATA_SOURCES`: ``apps``,
``taco``, ``codecontests``, ``codeforces``, scored by ``code``), else ``default_reward_fn`` (from
``reward_kwargs``).

The ``code`` reward runs programs in a sandbox: the local bubblewrap sandbox by default, configured by
``reward.custom_reward_function.reward_kwargs.code_sandbox`` (``max_concurrent``, ``python``,
``extra_ro_binds``, ``limits``: :func:`apertus_plugins.posttrain.sandbox.local_sandbox`), or, when verl's
``reward.sandbox_fusion.url`` is set, that SandboxFusion server through verl's client
(:mod:`verl_ext.sandbox_fusion`). Every sample of a batch carries the same extra-info keys (verl stacks
them): ``acc`` (the reward) and ``reward_info`` (JSON of the reward's extra information, e.g. the code
verdict of every test case; empty for the plain rewards).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from typing import Any

from apertus_plugins.plugins import registry

__all__ = ["CODE_DATA_SOURCES", "code_runner", "compute_score", "register_reward_manager", "uniform_extra_info"]

#: verl's data-source names of code problems (``verl.utils.reward_score.default_compute_score``): the ``code`` reward
CODE_DATA_SOURCES = frozenset({"apps", "taco", "codecontests", "codeforces"})


def code_runner(options: Mapping[str, Any] | None = None) -> Any:
    """The code reward's backend for ``options``: ``{"backend": "local", ...local sandbox options}`` (default) or
    ``{"backend": "sandbox_fusion", "url": ..., "max_concurrent": ..., "memory_limit_mb": ..., "limits": ...}``."""
    opts = dict(options or {})
    backend = opts.pop("backend", "local")
    if backend == "local":
        from apertus_plugins.posttrain.sandbox import local_sandbox

        return local_sandbox(opts)
    if backend == "sandbox_fusion":
        from .sandbox_fusion import sandbox_fusion_runner

        if not opts.get("url"):
            raise ValueError("the sandbox_fusion code backend needs a url (reward.sandbox_fusion.url)")
        return sandbox_fusion_runner(**opts)
    raise ValueError(f"unknown code sandbox backend {backend!r}: use local or sandbox_fusion")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  default_reward_fn: str | None = None, code_sandbox: Mapping[str, Any] | None = None,
                  **kwargs: Any) -> float | dict[str, Any]:
    """Score one response with a reward function registered through ``apertus_reward_functions``.

    Returns the reward as a float, or, for a reward with extra information (``code``), the mapping
    ``{"score": float, ...}`` verl's reward managers take.
    """
    fns = registry().reward_functions
    extra = dict(extra_info or {})
    if data_source in fns:
        by_source = data_source
    else:
        by_source = "code" if str(data_source).lower() in CODE_DATA_SOURCES else default_reward_fn
    name = extra.get("reward_fn") or by_source
    if name is None:
        raise ValueError(f"no reward function for data_source {data_source!r}: set extra_info.reward_fn or "
                         f"reward_kwargs.default_reward_fn to one of {', '.join(sorted(fns))}")
    if name not in fns:
        raise KeyError(f"unknown reward function {name!r}; registered: {', '.join(sorted(fns))}")
    opts = {k: v for k, v in extra.items() if k in ("tool_name", "argument", "require_tool", "strict", "casefold")}
    opts.update(kwargs.pop("reward_options", None) or {})
    if name == "code":
        opts.setdefault("data_source", data_source)
        opts.setdefault("runner", code_runner(code_sandbox))
    result = fns[name](solution_str, ground_truth, **opts)
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"reward function {name!r} returned a mapping without 'score': {sorted(result)}")
        return {**result, "score": float(result["score"])}
    return float(result)


def uniform_extra_info(score: float, info: Mapping[str, Any]) -> dict[str, Any]:
    """The extra-info keys every sample carries: ``acc`` and ``reward_info`` (JSON of the rest, or empty)."""
    rest = {k: v for k, v in info.items() if k not in ("acc", "score")}
    return {"acc": float(score), "reward_info": json.dumps(rest, ensure_ascii=False, default=str) if rest else ""}


def _with_sandbox_fusion(fn: Any, sandbox: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("code_sandbox", dict(sandbox))
    return fn(*args, **kwargs)


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
        """verl's naive reward manager, decoding with special tokens kept, scoring with :func:`compute_score`.

        With verl's ``reward.sandbox_fusion.url`` set, the ``code`` reward runs programs on that server;
        every sample's extra info has the same keys (:func:`uniform_extra_info`).
        """

        def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None, **kw: Any) -> None:
            # verl's load_reward_manager passes config, tokenizer and compute_score by keyword
            score = compute_score or _compute_score
            fusion = (config.get("reward", {}) or {}).get("sandbox_fusion") if hasattr(config, "get") else None
            if fusion and fusion.get("url"):
                score = partial(_with_sandbox_fusion, score, {
                    "backend": "sandbox_fusion", "url": str(fusion["url"]),
                    "max_concurrent": int(fusion.get("max_concurrent") or 64),
                    "memory_limit_mb": int(fusion.get("memory_limit_mb") or 1024)})
            super().__init__(config, _KeepSpecialTokens(tokenizer), score, **kw)

        async def run_single(self, data: Any) -> dict:
            out = await super().run_single(data)
            out["reward_extra_info"] = uniform_extra_info(out["reward_score"], out.get("reward_extra_info") or {})
            return out

    globals()["ApertusRewardManager"] = ApertusRewardManager
    globals()["NoRewardManager"] = NoRewardManager
    return ApertusRewardManager
