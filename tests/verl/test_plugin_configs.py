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
out = {
    "plugin_loaded": "verl_ext.plugin" in sys.modules,
    "reward_manager": get_reward_manager_cls("apertus").__name__,
    "trainers": [get_trainer_cls(n).__name__ for n in ("apertus_sdpo", "apertus_online_dpo")],
}
print("PROBE" + json.dumps(out))
"""


def test_entry_point_registers_in_a_fresh_process():
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("PROBE"))
    got = json.loads(line[5:])
    assert got == {"plugin_loaded": True, "reward_manager": "ApertusRewardManager",
                   "trainers": ["SDPOTrainer", "OnlineDPOTrainer"]}
    # with verl's switch off, nothing is loaded
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    off = subprocess.run([sys.executable, "-c", "import sys, verl; print('verl_ext.plugin' in sys.modules)"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert off.stdout.strip().endswith("False")


def test_version_check_names_the_supported_range():
    from verl_ext.plugin import check_version

    check_version("0.9.1")
    with pytest.raises(RuntimeError, match=r"supports verl >=0.9,<0.10; found verl 0.8.0"):
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
    for cfg in (sd, od, off):
        omega_conf_to_dataclass(cfg.algorithm, dataclass_type=AlgoConfig)
        # the actor's model_config is filled at run time by verl; its optimizer converts as is
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
