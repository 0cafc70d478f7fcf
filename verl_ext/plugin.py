"""The ``verl.plugins`` entry point: verl imports this module in every process (``import verl``).

It checks the verl version, then registers with verl's own registries:

* the reward managers ``apertus`` and ``none`` (``reward.reward_manager.name``);
* the trainers ``apertus_sdpo``, ``apertus_online_dpo`` and ``apertus_offline_dpo``
  (``trainer.v1.trainer_mode``), and the rollout backend ``none`` (``actor_rollout_ref.rollout.name``:
  a trainer without an inference engine, offline DPO);
* the agent loop ``apertus_single_turn`` (``actor_rollout_ref.rollout.agent.default_agent_loop``):
  rollout prompt ids from the core's injection-safe chat encoding (:mod:`verl_ext.agent_loop`);
* with ``transformers``' Auto classes, the Apertus 1.5 configs and the text-only causal LM
  :class:`apertus_plugins.hf.modeling.Apertus1p5ForCausalLM` (``AutoModelForCausalLM`` and
  ``AutoModelForImageTextToText``, where the installed ``transformers`` has no ``apertus1p5``), so that
  verl loads a released Apertus 1.5 checkpoint from ``actor_rollout_ref.model.path`` as that class:
  the FSDP engine's ``get_hf_auto_model_class`` picks ``AutoModelForImageTextToText`` for a config type it
  maps, and the checkpoint manager and model merger pick it for ``...ForConditionalGeneration``.

The RLVR preset needs nothing registered: it selects verl's RLOO, group filtering and GMPO
(``geo_mean``) by name. verl swallows exceptions raised by plugins, so failures are logged
here as warnings that name the cause. Registration is idempotent.
"""

from __future__ import annotations

import logging

from apertus_plugins.infra.versions import SUPPORTED as VERSIONS
from apertus_plugins.infra.versions import require

logger = logging.getLogger("verl_ext")

SUPPORTED = VERSIONS["verl"].specifier  #: verl 0.9.x
REGISTERED: dict[str, list[str]] = {"reward_managers": [], "trainers": [], "transformers": [], "agent_loops": [],
                                    "rollout_backends": []}


def check_version(version: str) -> None:
    """Fail with a clear message unless ``version`` is in the supported range (0.9.x)."""
    require("verl", version)


def register() -> dict[str, list[str]]:
    import verl

    check_version(getattr(verl, "__version__", "0"))
    from apertus_plugins.hf.modeling import register as register_transformers

    REGISTERED["transformers"] += register_transformers()
    from .rewards import register_reward_manager

    register_reward_manager()
    for name in ("apertus", "none"):
        if name not in REGISTERED["reward_managers"]:
            REGISTERED["reward_managers"].append(name)
    try:
        from . import trainers  # noqa: F401  (registers through verl's register_trainer)
    except ImportError as exc:  # the v1 trainer needs transfer_queue
        logger.warning("apertus trainers not registered: %s", exc)
    else:
        for name in ("apertus_sdpo", "apertus_online_dpo", "apertus_offline_dpo"):
            if name not in REGISTERED["trainers"]:
                REGISTERED["trainers"].append(name)
        if "none" not in REGISTERED["rollout_backends"]:
            REGISTERED["rollout_backends"].append("none")
    from . import agent_loop  # noqa: F401  (registers through verl's agent-loop register)

    if "apertus_single_turn" not in REGISTERED["agent_loops"]:
        REGISTERED["agent_loops"].append("apertus_single_turn")
    return REGISTERED


try:
    register()
except Exception as exc:  # noqa: BLE001 - verl would hide it; say it loudly instead
    logger.warning("apertus verl plugin not loaded: %s", exc)
    raise
