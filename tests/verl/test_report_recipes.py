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
  filtered, clipping (0.2, 0.28), geometric-mean loss, no KL penalty, AdamW at 1e-6.
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
    "apertus_rlvr": {  # Appendix G (RL paragraph); Section 4.5
        "rollouts": 8, "advantage": "rloo", "filter_zero_variance": True, "clip": (0.2, 0.28),
        "loss": "geo_mean", "kl": False, "lr": 1e-6, "optimizer": "AdamW",
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
           "apertus_rlvr": ("apertus_rlvr", [])}


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
                   kl=bool(actor.use_kl_loss or cfg.algorithm.use_kl_in_reward), optimizer=actor.optim.optimizer)
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
