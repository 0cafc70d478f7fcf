"""SDPO and online DPO trainers on verl's v1 trainer (``trainer.use_v1=true``, the 0.9 default).

Registered with verl's own trainer registry (``register_trainer``) and selected by
``trainer.v1.trainer_mode`` (``apertus_sdpo``, ``apertus_online_dpo``), so they launch through
verl's entry point with the configs shipped in this package::

    python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=apertus_sdpo ...

Each trainer swaps in :class:`ApertusActorRolloutRefWorker` (verl's worker plus one method that
installs the stage's loss function next to the frozen reference model) and overrides the step
pipeline (``_step_once``); everything else (rollout servers, weight sync, checkpoints, logging)
is verl's. The stage settings live under the top-level ``apertus`` config group.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np
import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta
from verl.single_controller.base.decorator import Dispatch, register
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.debug import marked_timer
from verl.workers.engine_workers import ActorRolloutRefWorker

from apertus_plugins.chat import ChatTokenizer, parse_output
from apertus_plugins.judges import make_judge

from . import dpo, sdpo
from .schedule import install_lr_schedule

logger = logging.getLogger(__name__)

__all__ = ["ApertusActorRolloutRefWorker", "SDPOTrainer", "OnlineDPOTrainer"]


class ApertusActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's actor/rollout/ref worker with the Apertus stage losses."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def apertus_install_loss(self, stage: str, options: dict[str, Any]) -> None:
        actor_config = omega_conf_to_dataclass(self.config.actor)
        if stage == "sdpo":
            if self.ref is None:
                raise RuntimeError("SDPO needs the frozen initial policy: run the worker with the ref role "
                                   "(actor_rollout_ref.actor.use_kl_loss=true builds it)")
            teacher = sdpo.packed_teacher_forward(self.ref.engine.module)
            fn = sdpo.make_sdpo_loss_fn(actor_config, teacher, k=int(options.get("topk", 64)),
                                        is_clip=options.get("is_clip", 2.0))
        elif stage in ("online_dpo", "offline_dpo"):
            fn = partial(dpo.dpo_loss_fn, config=actor_config, beta=float(options.get("beta", 0.1)),
                         length_normalize=bool(options.get("length_normalize", False)))
        else:
            raise ValueError(f"unknown apertus stage {stage!r}")
        self.actor.set_loss_fn(fn)
        # verl's FSDP engine knows constant and cosine only; the DPO stages decay linearly
        install_lr_schedule(self.actor.engine, str(options.get("lr_schedule", "verl")))


class _ApertusTrainer(PPOTrainerSync):
    stage = ""

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        for role in list(self.role_worker_mapping):
            if role in (Role.ActorRolloutRef, Role.ActorRollout, Role.Actor):
                self.role_worker_mapping[role] = ray.remote(ApertusActorRolloutRefWorker)

    def on_init_end(self) -> None:
        super().on_init_end()
        opts = OmegaConf.to_container(self.config.apertus, resolve=True)
        self.actor_rollout_wg.apertus_install_loss(self.stage, opts.get(self.stage, {}))
        judge_cfg = dict(opts["judge"])
        self.judge = make_judge(judge_cfg.pop("backend", "openai"), **judge_cfg)
        self.judge.check()  # fail at start, not after the first rollout, when the judge is down
        self.chat_tokenizer = ChatTokenizer(self.config.actor_rollout_ref.model.get("tokenizer_path")
                                            or self.config.actor_rollout_ref.model.path)

    def _texts(self, batch: KVBatchMeta) -> tuple[list[Any], list[str], list[str]]:
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["responses", "raw_prompt"])
        raw = [list(m) for m in data["raw_prompt"]]
        prompts = [next(m["content"] for m in reversed(msgs) if m.get("role") == "user") for msgs in raw]
        prompts = [p if isinstance(p, str) else " ".join(x.get("text", "") for x in p) for p in prompts]
        responses = [parse_output(self.chat_tokenizer.decode(r.tolist())).content for r in data["responses"].unbind()]
        return raw, prompts, responses

    def _update(self, batch: KVBatchMeta, metrics: dict, extra: dict[str, Any]) -> None:
        rows = len(batch.keys)
        batch.extra_info.update({"calculate_entropy": False, "global_batch_size": rows, "mini_batch_size": rows,
                                 "epochs": 1, "seed": self.config.actor_rollout_ref.actor.data_loader_seed,
                                 "dataloader_kwargs": {"shuffle": False},
                                 "temperature": self.config.actor_rollout_ref.rollout.temperature, **extra})
        out = self.actor_rollout_wg.update_actor(batch)
        from verl.utils.metric import reduce_metrics
        from verl.utils.py_functional import rename_dict

        metrics.update(reduce_metrics(rename_dict(out["metrics"], "actor/")))


@register_trainer("apertus_sdpo")
class SDPOTrainer(_ApertusTrainer):
    """SDPO: rollouts -> judge feedback -> teacher prompts -> top-k/tail reverse KL to the frozen teacher."""

    stage = "sdpo"

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        with marked_timer("gen", timing_raw, color="red"):
            self.on_sample_begin()
            batch, off_policy_metrics = self.replay_buffer.sample(global_steps=self.global_steps,
                                                                  partition_id="train", batch_size=sample_batch_size)
            metrics.update(off_policy_metrics)
            self.on_sample_end()
        batch = self._balance_batch(batch, metrics=metrics)
        with marked_timer("old_log_prob", timing_raw, color="blue"):
            batch = self._compute_old_log_prob(batch, metrics=metrics)  # bypass mode: the rollout's log-probs
        with marked_timer("judge", timing_raw, color="yellow"):
            raw, prompts, responses = self._texts(batch)
            feedback = sdpo.collect_feedback(self.judge, prompts, responses)
            opts = self.config.apertus.sdpo
            teacher = sdpo.build_teacher_prompts(self.chat_tokenizer, raw, feedback,
                                                 template=opts.get("teacher_template") or sdpo.DEFAULT_TEACHER_TEMPLATE)
            nested = torch.nested.as_nested_tensor([torch.tensor(t) for t in teacher], layout=torch.jagged)
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                            fields=tq_fields({"teacher_prompts": nested}, len(batch.keys)))
            metrics["sdpo/feedback_chars"] = float(np.mean([len(f) for f in feedback]))
        with marked_timer("update_actor", timing_raw, color="red"):
            self._update(batch, metrics, {"distillation_use_topk": True, "distillation_only": False,
                                          "micro_batch_size_per_gpu": None})
        return batch


@register_trainer("apertus_online_dpo")
class OnlineDPOTrainer(_ApertusTrainer):
    """Online DPO: N rollouts per prompt -> judge ratings -> MaxMin pairs -> DPO against the reference."""

    stage = "online_dpo"

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        with marked_timer("gen", timing_raw, color="red"):
            self.on_sample_begin()
            batch, off_policy_metrics = self.replay_buffer.sample(global_steps=self.global_steps,
                                                                  partition_id="train", batch_size=sample_batch_size)
            metrics.update(off_policy_metrics)
            self.on_sample_end()
        with marked_timer("judge", timing_raw, color="yellow"):
            _, prompts, responses = self._texts(batch)
            scores = dpo.judge_scores(self.judge, prompts, responses)
            uids = list(tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                        select_fields=["uid"])["uid"].tolist())
            pairs, pair_metrics = dpo.maxmin_pairs(uids, scores)
            metrics.update(pair_metrics)
            metrics["dpo/judge_score_mean"] = float(np.mean(scores))
        rows = [r for pair in pairs for r in pair]
        dp_size = max(self.actor_rollout_wg._query_dispatch_info("actor")) + 1
        n_pairs = (len(pairs) // dp_size) * dp_size  # whole pairs per rank
        rows = rows[: 2 * n_pairs]
        seqlens = [batch.tags[r]["seq_len"] for r in rows]
        order = dpo.balance_pairs(seqlens, dp_size)
        rows = [rows[i] for i in order]
        pair_batch = KVBatchMeta(partition_id=batch.partition_id, keys=[batch.keys[r] for r in rows],
                                 tags=[batch.tags[r] for r in rows], extra_info=dict(batch.extra_info))
        pid = torch.arange(len(rows), dtype=torch.int64) // dpo.PAIR_GROUP_SIZE  # balance_pairs keeps pairs adjacent
        tq.kv_batch_put(keys=pair_batch.keys, partition_id=pair_batch.partition_id,
                        fields=tq_fields({"pair_id": pid}, len(rows)))
        with marked_timer("ref", timing_raw, color="olive"):
            pair_batch = self._compute_ref_log_prob(pair_batch, metrics=metrics)
        with marked_timer("update_actor", timing_raw, color="red"):
            self._update(pair_batch, metrics, {"force_group_size": dpo.PAIR_GROUP_SIZE})
        return batch


def tq_fields(fields: dict[str, Any], batch_size: int) -> Any:
    from tensordict import TensorDict

    return TensorDict(fields, batch_size=batch_size)
