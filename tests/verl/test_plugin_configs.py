"""Registration through the verl.plugins entry point in a fresh process; configs compose with verl's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, verl, sys
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
from verl.trainer.ppo.v1 import get_trainer_cls
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
cfg = CONFIG_MAPPING["apertus1p5"]
out = {
    "transformers": [cfg.__module__] + [a._model_mapping[cfg].__name__ for a in (AutoModelForCausalLM, AutoModelForImageTextToText)],
    "plugin_loaded": "verl_ext.plugin" in sys.modules,
    "reward_manager": get_reward_manager_cls("apertus").__name__,
    "trainers": [get_trainer_cls(n).__name__ for n in ("apertus_sdpo", "apertus_online_dpo", "apertus_offline_dpo",
                                                       "apertus_colocate_async", "apertus_separate_async")],
}
print("PROBE" + json.dumps(out))
"""


def test_entry_point_registers_in_a_fresh_process():
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("PROBE"))
    got = json.loads(line[5:])
    assert got == {"transformers": ["apertus_plugins.hf.configs", "Apertus1p5ForCausalLM", "Apertus1p5ForCausalLM"],
                   "plugin_loaded": True, "reward_manager": "ApertusRewardManager",
                   "trainers": ["SDPOTrainer", "OnlineDPOTrainer", "OfflineDPOTrainer", "RLVRColocateAsyncTrainer",
                                "RLVRSeparateAsyncTrainer"]}
    # with verl's switch off, nothing is loaded
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    off = subprocess.run([sys.executable, "-c", "import sys, verl; print('verl_ext.plugin' in sys.modules)"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert off.stdout.strip().endswith("False")


def test_version_check_names_the_supported_range():
    from verl_ext.plugin import check_version

    check_version("0.9.1")
    with pytest.raises(RuntimeError, match=r"supports verl >=0.9,<0.10; this environment has verl 0.8.0"):
        check_version("0.8.0")


def _compose(name, overrides=()):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl_ext.config", version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_rlvr_preset_composes_with_verl_and_selects_verls_algorithms():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

    cfg = _compose("apertus_rlvr")
    a = cfg.actor_rollout_ref.actor
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.algorithm.filter_groups.enable
    assert (a.clip_ratio_low, a.clip_ratio_high, a.policy_loss.loss_mode) == (0.2, 0.28, "geo_mean")
    assert not a.use_kl_loss and not cfg.algorithm.use_kl_in_reward
    assert a.optim.lr == 1e-6 and cfg.actor_rollout_ref.rollout.n == 8
    # everything else is verl's own default tree
    assert "critic" in cfg and "rollout" in cfg.actor_rollout_ref and cfg.trainer.use_v1
    get_adv_estimator_fn(cfg.algorithm.adv_estimator)
    get_policy_loss_fn(a.policy_loss.loss_mode)
    assert cfg.reward.custom_reward_function.path == "pkg://verl_ext.rewards"
    from verl.utils.import_utils import load_extern_object

    assert load_extern_object(cfg.reward.custom_reward_function.path, cfg.reward.custom_reward_function.name)


def test_stage_configs_compose_and_convert_to_verls_dataclasses():
    from verl.trainer.config import AlgoConfig
    from verl.utils.config import omega_conf_to_dataclass

    sd = _compose("apertus_sdpo", ["apertus.judge.base_url=http://127.0.0.1:9/v1"])
    assert sd.trainer.v1.trainer_mode == "apertus_sdpo" and sd.actor_rollout_ref.rollout.n == 16
    assert sd.apertus.sdpo.topk == 64 and sd.apertus.sdpo.is_clip == 2.0
    assert sd.apertus.judge.base_url == "http://127.0.0.1:9/v1" and sd.apertus.judge.aspect == "charter alignment"
    assert sd.actor_rollout_ref.actor.optim.lr == 1e-7 and sd.data.train_batch_size == 64
    od = _compose("apertus_online_dpo")
    assert od.actor_rollout_ref.rollout.n == 12 and od.apertus.online_dpo.beta == 0.1
    assert not od.actor_rollout_ref.actor.shuffle and list(od.apertus.judge.scale) == [1, 5]
    off = _compose("apertus_offline_dpo", ["apertus.offline_dpo.pair_file=/x.jsonl"])
    assert off.apertus.offline_dpo.length_normalize and off.apertus.offline_dpo.beta == 25.0
    # one epoch each, as the report trains them (report 4.6, Table G.2)
    assert sd.trainer.total_epochs == od.trainer.total_epochs == off.trainer.total_epochs == 1
    # the judge stages need the charter: no silent sample (the sample is named: @sample)
    from omegaconf import OmegaConf

    assert OmegaConf.is_missing(sd.apertus.judge, "charter") and OmegaConf.is_missing(od.apertus.judge, "charter")
    assert _compose("apertus_sdpo", ["apertus.judge.charter=@sample"]).apertus.judge.charter == "@sample"
    for cfg in (sd, od, off):
        omega_conf_to_dataclass(cfg.algorithm, dataclass_type=AlgoConfig)
        # the actor's model_config is filled at run time by verl; its optimizer converts as is
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)


# the launch example's micro-batch settings (verl requires them; the configs leave them to the user)
MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]


def test_dpo_configs_carry_the_spec_recipe_and_pass_verls_validation():
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import FSDPOptimizerConfig

    off = _compose("apertus_offline_dpo", ["apertus.offline_dpo.pair_file=/x.jsonl", *MICRO])
    od = _compose("apertus_online_dpo", MICRO)
    # SPEC section 6, offline DPO (70B): length-normalized, beta 25, LR 1e-6 linear with warmup 0.1, AdamW
    # without weight decay, 128 pairs, 4,096 tokens per sequence
    o = off.apertus.offline_dpo
    assert (o.beta, o.length_normalize, o.lr_schedule, o.max_length) == (25.0, True, "linear", 4096)
    assert off.data.train_batch_size == 128 and off.data.max_prompt_length == off.data.max_response_length == 4096
    # SPEC section 6, online DPO (8B): beta 0.1, LR 5e-6 linear with warmup 0.1, weight decay 0.01,
    # 256 prompts x 12 rollouts at temperature 1 (unrestricted top-p/top-k), 2,048 + 2,048 tokens, thinking off
    assert (od.apertus.online_dpo.beta, od.apertus.online_dpo.length_normalize) == (0.1, False)
    assert od.apertus.online_dpo.lr_schedule == "linear"
    r = od.actor_rollout_ref.rollout
    assert (r.n, r.temperature, r.top_p, r.top_k) == (12, 1.0, 1.0, -1)
    assert (od.data.train_batch_size, od.data.max_prompt_length, od.data.max_response_length) == (256, 2048, 2048)
    assert not od.data.apply_chat_template_kwargs.enable_thinking
    assert not off.data.apply_chat_template_kwargs.enable_thinking
    for cfg, lr, wd in ((off, 1e-6, 0.0), (od, 5e-6, 0.01)):
        optim = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
        assert isinstance(optim, FSDPOptimizerConfig) and optim.optimizer == "AdamW"
        assert (optim.lr, optim.weight_decay, optim.lr_warmup_steps_ratio, tuple(optim.betas)) == (lr, wd, 0.1, (0.9, 0.999))
        assert optim.min_lr_ratio == 0.0  # the linear decay ends at zero
        assert cfg.trainer.total_epochs == 1
        # a frozen reference model, no critic; verl's own validation accepts the whole tree
        assert need_reference_policy(cfg) and not need_critic(cfg)
        validate_config(cfg, use_reference_policy=True, use_critic=False)
    # SDPO keeps verl's schedule (10 warmup steps, then constant)
    sd = _compose("apertus_sdpo", ["apertus.judge.base_url=http://127.0.0.1:9/v1"])
    assert sd.apertus.sdpo.get("lr_schedule", "verl") == "verl" and sd.actor_rollout_ref.actor.optim.lr_warmup_steps == 10


def test_offline_dpo_config_selects_the_trainer_and_no_rollout():
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils.import_utils import load_class_from_fqn

    import verl_ext.plugin
    from verl_ext.trainers import NoRollout, OfflineDPOTrainer

    verl_ext.plugin.register()
    off = _compose("apertus_offline_dpo", ["apertus.offline_dpo.pair_file=/x.jsonl"])
    assert off.trainer.v1.trainer_mode == "apertus_offline_dpo" and off.trainer.use_v1
    assert get_trainer_cls(off.trainer.v1.trainer_mode) is OfflineDPOTrainer
    assert OfflineDPOTrainer.stage == "offline_dpo" and not OfflineDPOTrainer.uses_judge
    assert OfflineDPOTrainer._enable_hybrid_replicas is False  # verl builds no rollout replicas
    # no generation: validation is off, and the agent-loop manager verl's task runner builds is NoRollout
    assert not off.trainer.val_before_train and off.trainer.test_freq == -1
    cls = load_class_from_fqn(off.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    assert cls is NoRollout
    manager = cls.create(config=off, llm_client=None, teacher_client=None, reward_loop_worker_handles=None)
    with pytest.raises(RuntimeError, match="generates nothing"):
        manager.generate_sequences(None)
    # verl resolves a rollout backend even here: `none`, whose replica class imports no engine
    import sys

    from verl.workers.rollout.replica import get_rollout_replica_class

    from verl_ext.trainers import NoRolloutReplica

    assert off.actor_rollout_ref.rollout.name == "none" and off.actor_rollout_ref.rollout.nnodes == 1
    assert get_rollout_replica_class("none") is NoRolloutReplica and "vllm" not in sys.modules
    # the pair file is required
    from omegaconf.errors import MissingMandatoryValue

    with pytest.raises(MissingMandatoryValue):
        _ = _compose("apertus_offline_dpo").apertus.offline_dpo.pair_file


def test_rollout_stages_use_the_apertus_agent_loop_and_the_judge_stages_no_reward():
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

    import verl_ext.plugin

    verl_ext.plugin.register()
    judge = ["apertus.judge.base_url=http://127.0.0.1:9/v1"]
    for name in ("apertus_sdpo", "apertus_online_dpo", "apertus_rlvr"):
        cfg = _compose(name, judge if name != "apertus_rlvr" else [])
        assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "apertus_single_turn"
    assert _agent_loop_registry["apertus_single_turn"]["_target_"] == "verl_ext.agent_loop.ApertusSingleTurnAgentLoop"
    for name in ("apertus_sdpo", "apertus_online_dpo"):
        cfg = _compose(name, judge)
        assert cfg.reward.reward_manager.name == "none" and cfg.apertus.check_rollout_sync is False
    assert get_reward_manager_cls("none").__name__ == "NoRewardManager"


def test_a_third_party_judge_with_only_the_abstract_methods_serves_both_stages():
    """A backend implementing only Judge.feedback and Judge.rate: the base class gives check and the batches."""
    from apertus_plugins.posttrain.judges import Judge
    from verl_ext.dpo import judge_scores
    from verl_ext.sdpo import collect_feedback

    class LengthJudge(Judge):
        def feedback(self, prompt, response):
            return f"{prompt}: {len(response)} characters"

        def rate(self, prompt, response):
            return float(len(response) % 5 + 1)

    judge = LengthJudge()
    assert judge.check() is None
    assert collect_feedback(judge, ["p", "q"], ["ab", "abcd"]) == ["p: 2 characters", "q: 4 characters"]
    assert judge_scores(judge, ["p", "q"], ["ab", "abcd"]) == [3.0, 5.0]
    with pytest.raises(TypeError):
        type("Half", (Judge,), {"rate": lambda self, p, r: 1.0})()  # feedback missing: not a judge


def test_rlvr_modes_are_verls_with_the_truncation_rate_against_the_cap():
    """verl 0.9's v1 PPO metrics pad a step's responses to its longest, so its ``response_length/clip_ratio``
    counts the responses as long as the longest; the RLVR modes count those that reached the cap."""
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_ext.trainers import RLVRColocateAsyncTrainer, RLVRSeparateAsyncTrainer, truncation_ratio

    assert issubclass(RLVRColocateAsyncTrainer, PPOTrainerColocateAsync)
    assert issubclass(RLVRSeparateAsyncTrainer, PPOTrainerSeparateAsync)
    assert (RLVRColocateAsyncTrainer.verl_mode, RLVRSeparateAsyncTrainer.verl_mode) == ("colocate_async",
                                                                                        "separate_async")
    lengths = [172, 40, 12, 90, 3, 77, 100, 8]  # the CPU run's step: verl logged 0.125 (one as long as the longest)
    assert truncation_ratio(lengths, 448) == 0.0
    assert truncation_ratio(lengths, 100) == 0.25
    assert truncation_ratio([448, 448], 448) == 1.0
    with pytest.raises(ValueError, match="max_response_length"):
        truncation_ratio(lengths, 0)
