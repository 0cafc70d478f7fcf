"""The Megatron presets (``apertus_*_megatron``) compose with verl's own Hydra tree and equal their FSDP presets.

Each preset is composed the way ``python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config
--config-name=...`` composes it (verl's ``verl.trainer.config`` on the search path). It must select verl's
Megatron engine for the actor and the reference model, register the Apertus bridge in the workers
(``external_lib``), carry the 8B's parallel sizes (report Table G.1: TP2), and otherwise resolve to the
same tree as the FSDP preset of the same stage: the only differences are the engine's own subtrees and
the learning-rate schedule's home (verl's Megatron optimizer decays linearly itself). No training runs
here: verl's Megatron engine needs a GPU (``benchmarks/gpu/verl_megatron.sh``).
"""

from __future__ import annotations

from typing import Any

import pytest

STAGES = ("sdpo", "online_dpo", "offline_dpo")
# what every stage needs to compose to a complete tree (the launch example's settings)
OVERRIDES = [
    "apertus.judge.charter=@sample",
    "apertus.offline_dpo.pair_file=/x.jsonl",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
]
# the subtrees whose schema is the engine's (verl's dp_* against megatron_* configs)
ENGINE_TREES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
ENGINE_OWN = (
    "fsdp_config",
    "fsdp",
    "megatron",
    "_target_",
    "strategy",
    "checkpoint._target_",
    "optim._target_",
    # verl's own defaults, one per engine: AdamW (torch) against Megatron's adam (which is AdamW)
    "optim.optimizer",
)


def _compose(name: str, overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl_ext.config", version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    GlobalHydra.instance().clear()
    return cfg


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _pair(stage: str, extra: tuple[str, ...] = (), megatron_only: tuple[str, ...] = ()) -> tuple[Any, Any]:
    overrides = [o for o in OVERRIDES if stage != "offline_dpo" or not o.startswith("apertus.judge")]
    overrides = [o for o in overrides if stage == "offline_dpo" or not o.startswith("apertus.offline_dpo")]
    return (
        _compose(f"apertus_{stage}_megatron", [*overrides, *extra, *megatron_only]),
        _compose(f"apertus_{stage}", [*overrides, *extra]),
    )


@pytest.mark.parametrize("stage", STAGES)
def test_megatron_preset_selects_verls_megatron_engine_and_the_bridge(stage: str) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

    mega, _ = _pair(stage)
    assert mega.model_engine == "megatron"
    actor, ref = mega.actor_rollout_ref.actor, mega.actor_rollout_ref.ref
    assert actor.strategy == ref.strategy == "megatron"
    # verl imports this module in every worker: it registers the Apertus bridge with Megatron-Bridge
    assert mega.actor_rollout_ref.model.external_lib == "megatron_patches.bridge"
    # the 8B's parallelism (report Table G.1: TP2); the reference model follows the actor
    sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    for tree in (actor.megatron, ref.megatron):
        assert tuple(tree[k] for k in sizes) == (2, 1, 1) and tree.virtual_pipeline_model_parallel_size is None
    # Megatron-Bridge, not verl's deprecated mbridge path (which has no Apertus model)
    assert actor.megatron.use_mbridge and not actor.megatron.vanilla_mbridge
    assert not ref.megatron.vanilla_mbridge and ref.megatron.forward_only
    # the trees are verl's Megatron dataclasses, with no FSDP-only key left over
    engine = omega_conf_to_dataclass(actor.megatron)
    optim = omega_conf_to_dataclass(actor.optim)
    assert isinstance(engine, McoreEngineConfig) and isinstance(optim, McoreOptimizerConfig)
    assert isinstance(omega_conf_to_dataclass(ref.megatron), McoreEngineConfig)
    assert need_reference_policy(mega) and not need_critic(mega)
    validate_config(mega, use_reference_policy=True, use_critic=False)
    # the 70B's layout is an override of the same preset (Table G.1: TP4, PP8, VPP2)
    big, _ = _pair(
        stage,
        megatron_only=(
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=8",
            "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
        ),
    )
    for tree in (big.actor_rollout_ref.actor.megatron, big.actor_rollout_ref.ref.megatron):
        assert (
            tree.tensor_model_parallel_size,
            tree.pipeline_model_parallel_size,
            tree.virtual_pipeline_model_parallel_size,
        ) == (4, 8, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_megatron_preset_equals_its_fsdp_preset_outside_the_engine(stage: str) -> None:
    from omegaconf import OmegaConf

    mega, fsdp = _pair(stage)
    m, f = (_flat(OmegaConf.to_container(c, resolve=True)) for c in (mega, fsdp))

    def engine_own(key: str) -> bool:
        for tree in ENGINE_TREES:
            if key.startswith(tree + "."):
                rest = key[len(tree) + 1 :]
                return any(rest == own or rest.startswith(own + ".") for own in ENGINE_OWN)
        # verl copies the actor engine's quantization defaults into the rollout's
        return key.startswith("actor_rollout_ref.rollout.qat.")

    differ = {
        k: (f.get(k, "<unset>"), m.get(k, "<unset>"))
        for k in sorted(set(m) | set(f))
        if m.get(k, "<unset>") != f.get(k, "<unset>") and not engine_own(k)
    }
    expected = {
        "model_engine": ("dp", "megatron"),
        "actor_rollout_ref.model.external_lib": (None, "megatron_patches.bridge"),
    }
    if stage != "sdpo":
        # the DPO stages' linear schedule: the FSDP engine gets the plugin's replacement, the Megatron
        # optimizer its own linear decay to zero
        expected[f"apertus.{stage}.lr_schedule"] = ("linear", "verl")
        expected["actor_rollout_ref.actor.optim.lr_scheduler_type"] = ("constant", "<unset>")
        expected["actor_rollout_ref.actor.optim.min_lr_ratio"] = (0.0, "<unset>")
        expected["actor_rollout_ref.actor.optim.lr_decay_style"] = ("<unset>", "linear")
        expected["actor_rollout_ref.actor.optim.min_lr"] = ("<unset>", 0.0)
    assert {k: differ.pop(k, None) for k in expected} == expected
    # what else differs: keys one engine's schema has and the other lacks, verl's own defaults
    assert all(k.startswith(ENGINE_TREES) and "<unset>" in v for k, v in differ.items()), differ
    recipe = (
        "optim.lr",
        "optim.weight_decay",
        "optim.lr_warmup_steps",
        "optim.lr_warmup_steps_ratio",
        "ppo_mini_batch_size",
        "use_kl_loss",
        "kl_loss_coef",
        "shuffle",
    )
    assert not any(k.endswith(recipe) for k in differ)
    # the recipe's own values reached both trees (not only verl's defaults)
    a, b = mega.actor_rollout_ref.actor, fsdp.actor_rollout_ref.actor
    assert (a.optim.lr, a.optim.weight_decay, a.use_kl_loss) == (b.optim.lr, b.optim.weight_decay, b.use_kl_loss)
    assert mega.trainer.v1.trainer_mode == fsdp.trainer.v1.trainer_mode == f"apertus_{stage}"


def test_online_dpo_megatron_preset_takes_the_70b_size_like_the_fsdp_one() -> None:
    mega, fsdp = _pair("online_dpo", ("online_dpo_size=70b",))
    for cfg in (mega, fsdp):
        assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n) == (512, 8)
        assert cfg.actor_rollout_ref.actor.optim.lr == 2.5e-6
