"""Every post-training stage's packaged config against a table written from the Apertus 1.5 technical report.

Sources (report, ``/work/shared/seed/000_8f0a8fb36c050ffe.txt`` when it is beside the checkout):

* Table G.2 ("Preference-alignment configurations"): offline DPO (70B), online DPO (8B), online DPO (70B):
  beta, learning rate, schedule, weight decay, batch size, rollouts per prompt, sequence length, epochs, steps.
* Section 4.6.1, "Offline DPO" and "Online DPO": AdamW (beta1 0.9, beta2 0.999, eps 1e-8), length
  normalization of the offline loss, temperature 1.0 with unrestricted top-p/top-k, 2,048 + 2,048 tokens,
  the epoch sizes (245,898 pairs; 242,688 online prompts), thinking disabled in both DPO stages.
* Section 4.6.2, "Training", and Appendix G (SDPO): batch 64, 16 rollouts, LR 1e-7 with 10 warmup steps,
  top-64 tokens plus a tail bucket, importance ratio clipped at 2, maximum model length 4,096, one epoch,
  thinking disabled.
* Appendix G (RL) and Section 4.5: 8 rollouts per prompt, leave-one-out advantages, zero-variance groups
  filtered, clipping (0.2, 0.28), geometric-mean loss, no KL penalty, AdamW at 1e-6; 480 optimizer steps
  for 8B ("roughly one million trajectories"), 180 for 70B; validation mean@4 with thinking disabled
  (Figure 11). Section 4.7 (Table 12, the RL ablation): rollouts at most two policy versions stale, new
  tokens capped at 14,336 with thinking on, a constant learning rate.

What the report does not print is marked CHOSEN below (the RL batch, prompt cap and validation cadence);
docs/verl.md gives the reasons.
"""

from __future__ import annotations

import pytest
import torch

# stage -> the report's numbers (keys name what they are; values as the report prints them)
REPORT = {
    "apertus_offline_dpo": {  # Table G.2, "Offline DPO (70B)"; Section 4.6.1 "Offline DPO"
        "beta": 25.0, "length_normalized": True, "lr": 1e-6, "schedule": "linear", "warmup_ratio": 0.1,
        "weight_decay": 0.0, "batch": 128, "max_length": 4096, "epochs": 1, "steps": 1921,
        "epoch_size": 245_898, "adam": (0.9, 0.999, 1e-8), "thinking": False,
    },
    "apertus_online_dpo": {  # Table G.2, "Online DPO (8B)"; Section 4.6.1 "Online DPO"
        "beta": 0.1, "length_normalized": False, "lr": 5e-6, "schedule": "linear", "warmup_ratio": 0.1,
        "weight_decay": 0.01, "batch": 256, "rollouts": 12, "prompt_length": 2048, "response_length": 2048,
        "epochs": 1, "steps": 948, "epoch_size": 242_688, "adam": (0.9, 0.999, 1e-8), "temperature": 1.0,
        "top_p": 1.0, "top_k": -1, "thinking": False,
    },
    "apertus_online_dpo_70b": {  # Table G.2, "Online DPO (70B)"; Section 4.6.1 "Online DPO"
        "beta": 0.1, "length_normalized": False, "lr": 2.5e-6, "schedule": "linear", "warmup_ratio": 0.1,
        "weight_decay": 0.01, "batch": 512, "rollouts": 8, "prompt_length": 2048, "response_length": 2048,
        "epochs": 1, "steps": 474, "epoch_size": 242_688, "adam": (0.9, 0.999, 1e-8), "temperature": 1.0,
        "top_p": 1.0, "top_k": -1, "thinking": False,
    },
    "apertus_sdpo": {  # Section 4.6.2 "Training"; Appendix G (SDPO paragraph)
        "batch": 64, "rollouts": 16, "lr": 1e-7, "warmup_steps": 10, "topk": 64, "is_clip": 2.0,
        "max_model_length": 4096, "epochs": 1, "thinking": False,
    },
    "apertus_rlvr": {  # Appendix G (RL paragraph); Section 4.5; Figure 11; Table 12
        "rollouts": 8, "advantage": "rloo", "filter_zero_variance": True, "clip": (0.2, 0.28),
        "loss": "geo_mean", "kl": False, "lr": 1e-6, "optimizer": "AdamW", "schedule": "constant",
        "steps": 480, "trajectories": 1_000_000, "response_length": 14_336, "val_n": 4, "val_thinking": False,
        "max_stale_versions": 2,
        "batch": 256, "prompt_length": 8192, "test_freq": 20,  # CHOSEN
    },
    "apertus_rlvr_70b": {  # Section 4.5: "the 70B run for 180 steps"; the rest as 8B
        "rollouts": 8, "advantage": "rloo", "filter_zero_variance": True, "clip": (0.2, 0.28),
        "loss": "geo_mean", "kl": False, "lr": 1e-6, "optimizer": "AdamW", "schedule": "constant",
        "steps": 180, "response_length": 14_336, "val_n": 4, "val_thinking": False, "max_stale_versions": 2,
        "batch": 256, "prompt_length": 8192, "test_freq": 20,  # CHOSEN
    },
}


def _compose(name, overrides=()):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl_ext.config", version_base=None):
        return compose(config_name=name, overrides=list(overrides))


#: the config (and overrides) of each row: the 70B online DPO is the online DPO config at online_dpo_size=70b
CONFIGS = {"apertus_offline_dpo": ("apertus_offline_dpo", ["apertus.offline_dpo.pair_file=/x.jsonl"]),
           "apertus_sdpo": ("apertus_sdpo", ["apertus.judge.charter=@sample"]),
           "apertus_online_dpo": ("apertus_online_dpo", ["apertus.judge.charter=@sample"]),
           "apertus_online_dpo_70b": ("apertus_online_dpo", ["apertus.judge.charter=@sample", "online_dpo_size=70b"]),
           "apertus_rlvr": ("apertus_rlvr", []),
           "apertus_rlvr_70b": ("apertus_rlvr", ["rlvr_size=70b"])}


def _adam(cfg) -> tuple[float, float, float]:
    """(beta1, beta2, eps) of the optimizer verl builds from the stage's config."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config.optimizer import build_optimizer

    optim = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], optim)
    assert type(opt).__name__ == "AdamW"
    group = opt.param_groups[0]
    assert group["lr"] == optim.lr and group["weight_decay"] == optim.weight_decay
    return (*group["betas"], group["eps"])


@pytest.mark.parametrize("stage", sorted(REPORT))
def test_stage_config_carries_the_reports_numbers(stage):
    want = REPORT[stage]
    cfg = _compose(*CONFIGS[stage])
    actor = cfg.actor_rollout_ref.actor
    rollout = cfg.actor_rollout_ref.rollout
    got: dict = {"lr": actor.optim.lr}
    if stage.startswith(("apertus_offline_dpo", "apertus_online_dpo")):
        key = "offline_dpo" if "offline" in stage else "online_dpo"
        opts = cfg.apertus[key]
        got.update(beta=opts.beta, length_normalized=opts.length_normalize, schedule=opts.lr_schedule,
                   warmup_ratio=actor.optim.lr_warmup_steps_ratio, weight_decay=actor.optim.weight_decay,
                   batch=cfg.data.train_batch_size, epochs=cfg.trainer.total_epochs, adam=_adam(cfg),
                   thinking=cfg.data.apply_chat_template_kwargs.enable_thinking,
                   # one optimizer update per batch, as the report counts steps
                   steps=want["epoch_size"] // cfg.data.train_batch_size, epoch_size=want["epoch_size"])
        assert actor.ppo_mini_batch_size == cfg.data.train_batch_size
        if "offline" in stage:
            got["max_length"] = opts.max_length
        else:
            got.update(rollouts=rollout.n, prompt_length=cfg.data.max_prompt_length,
                       response_length=cfg.data.max_response_length, temperature=rollout.temperature,
                       top_p=rollout.top_p, top_k=rollout.top_k)
    elif stage == "apertus_sdpo":
        got.update(batch=cfg.data.train_batch_size, rollouts=rollout.n, warmup_steps=actor.optim.lr_warmup_steps,
                   topk=cfg.apertus.sdpo.topk, is_clip=cfg.apertus.sdpo.is_clip,
                   max_model_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
                   epochs=cfg.trainer.total_epochs, thinking=cfg.data.apply_chat_template_kwargs.enable_thinking)
    else:
        got.update(rollouts=rollout.n, advantage=cfg.algorithm.adv_estimator,
                   filter_zero_variance=cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric
                   in ("reward", "acc"),
                   clip=(actor.clip_ratio_low, actor.clip_ratio_high), loss=actor.policy_loss.loss_mode,
                   kl=bool(actor.use_kl_loss or cfg.algorithm.use_kl_in_reward), optimizer=actor.optim.optimizer,
                   schedule=actor.optim.lr_scheduler_type if actor.optim.lr_warmup_steps_ratio == 0
                   and actor.optim.lr_warmup_steps <= 0 else "warmup",
                   steps=cfg.trainer.total_training_steps, response_length=cfg.data.max_response_length,
                   val_n=rollout.val_kwargs.n, val_thinking=cfg.data.apply_chat_template_kwargs.enable_thinking,
                   max_stale_versions=cfg.trainer.v1.sampler.max_off_policy_threshold,
                   batch=cfg.data.train_batch_size, prompt_length=cfg.data.max_prompt_length,
                   test_freq=cfg.trainer.test_freq)
        if "trajectories" in want:  # "480 optimizer steps, corresponding to roughly one million trajectories"
            trajectories = cfg.trainer.total_training_steps * cfg.data.train_batch_size * rollout.n
            assert abs(trajectories - want["trajectories"]) / want["trajectories"] < 0.05, trajectories
            got["trajectories"] = want["trajectories"]
        # one optimizer update per step; mean@4 is sampled; overlong prompts dropped before the run
        assert actor.ppo_mini_batch_size == cfg.data.train_batch_size and rollout.val_kwargs.do_sample
    if stage != "apertus_offline_dpo":
        assert cfg.data.filter_overlong_prompts is True, stage
        assert cfg.data.custom_cls.name == "ApertusRLDataset", stage
    assert got == want, stage


def test_the_table_is_consistent_with_itself():
    """The report's step counts follow from its epoch sizes and batch sizes (one update per batch, last partial
    batch dropped): 245,898 / 128 -> 1,921; 242,688 / 256 -> 948; 242,688 / 512 -> 474."""
    for stage in ("apertus_offline_dpo", "apertus_online_dpo", "apertus_online_dpo_70b"):
        row = REPORT[stage]
        assert row["epoch_size"] // row["batch"] == row["steps"], stage
    # 70B differs from 8B online DPO only in rollouts, batch, learning rate and steps (Table G.2)
    a, b = REPORT["apertus_online_dpo"], REPORT["apertus_online_dpo_70b"]
    assert sorted(k for k in a if a[k] != b[k]) == ["batch", "lr", "rollouts", "steps"]


def test_mixed_thinking_example_is_the_rlvr_recipe_with_per_prompt_thinking():
    mixed = _compose("apertus_rlvr", ["+thinking=mixed"])
    base = _compose("apertus_rlvr")
    from omegaconf import OmegaConf

    assert mixed.data.apply_chat_template_kwargs.enable_thinking is False  # records without the field: off
    mixed, base = OmegaConf.to_container(mixed), OmegaConf.to_container(base)
    for cfg in (mixed, base):
        cfg["data"].pop("apply_chat_template_kwargs")
    assert mixed == base  # the recipe is otherwise apertus_rlvr's


def test_fully_asynchronous_preset_is_verls_separate_async_with_one_update_per_step():
    """``+rlvr_async=separate``: verl's fully asynchronous trainer (standalone rollout pool, partial rollouts),
    composed with the RLVR recipe unchanged and satisfying verl's own batch rule (train_batch_size =
    parameter_sync_step x ppo_mini_batch_size), so a step is still one update as in the report."""
    from omegaconf import OmegaConf

    cfg = _compose("apertus_rlvr", ["+rlvr_async=separate"])
    base = _compose("apertus_rlvr")
    assert cfg.trainer.v1.trainer_mode == "apertus_separate_async" and cfg.actor_rollout_ref.hybrid_engine is False
    assert base.trainer.v1.trainer_mode == "apertus_colocate_async"
    v1 = cfg.trainer.v1.separate_async
    assert cfg.data.train_batch_size == v1.parameter_sync_step * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.nnodes > 0 and rollout.n_gpus_per_node > 0 and rollout.checkpoint_engine.backend != "naive"
    a, b = OmegaConf.to_container(cfg, resolve=True), OmegaConf.to_container(base, resolve=True)
    for c in (a, b):
        c["trainer"]["v1"].pop("trainer_mode"), c["trainer"]["v1"].pop("separate_async")
        c["actor_rollout_ref"].pop("hybrid_engine")
        for key in ("nnodes", "n_gpus_per_node", "checkpoint_engine"):
            c["actor_rollout_ref"]["rollout"].pop(key)
    assert a == b  # the recipe is otherwise apertus_rlvr's
