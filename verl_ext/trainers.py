"""SDPO, online DPO and offline DPO trainers on verl's v1 trainer (``trainer.use_v1=true``, the 0.9 default).

Registered with verl's own trainer registry (``register_trainer``) and selected by
``trainer.v1.trainer_mode`` (``apertus_sdpo``, ``apertus_online_dpo``, ``apertus_offline_dpo``),
so they launch through verl's entry point with the configs shipped in this package::

    python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=apertus_sdpo ...

Each trainer swaps in :class:`ApertusActorRolloutRefWorker` (verl's worker plus one method that
installs the stage's loss function next to the frozen reference model, and the stage's learning-rate
schedule) and overrides the step pipeline (``_step_once``); everything else (rollout servers, weight
sync, checkpoints, logging) is verl's, with verl's synchronous semantics (the synchronous replay
buffer and data loading). The offline trainer runs without rollout servers: an actor and a reference
worker group, the pairs read from a static file. The stage settings live under the top-level
``apertus`` config group.
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
from verl import DataProto
from verl.single_controller.base.decorator import Dispatch, register
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.debug import marked_timer
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

from apertus_plugins.core.chat import ChatTokenizer, visible_answer
from apertus_plugins.plugins import make_judge

from . import dpo, sdpo
from .schedule import install_lr_schedule

logger = logging.getLogger(__name__)

__all__ = ["ApertusActorRolloutRefWorker", "RLVRColocateAsyncTrainer", "RLVRSeparateAsyncTrainer", "SDPOTrainer", "OnlineDPOTrainer", "OfflineDPOTrainer", "NoRollout",
           "NoRolloutReplica"]


class ApertusActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's actor/rollout/ref worker with the Apertus stage losses."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def apertus_install_loss(self, stage: str, options: dict[str, Any]) -> None:
        actor_config = omega_conf_to_dataclass(self.config.actor)
        if stage == "sdpo":
            if self.ref is None:
                raise RuntimeError("SDPO needs the frozen initial policy: run the worker with the ref role "
                                   "(actor_rollout_ref.actor.use_kl_loss=true builds it)")
            module = self.ref.engine.module
            # verl packs the rows into one sequence with use_remove_padding (a varlen attention kernel);
            # without it the teacher runs on right-padded rows with an attention mask
            teacher = (sdpo.packed_teacher_forward(module) if self.config.model.get("use_remove_padding", True)
                       else sdpo.padded_teacher_forward(module))
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


class _ApertusTrainer:
    """What every Apertus stage trainer adds to verl's :class:`PPOTrainer` (mixed in before it)."""

    stage = ""
    uses_judge = True

    def _build_replay_buffer(self) -> Any:
        # the registered name only selects the class: the stages run verl's synchronous pipeline
        # (synchronous replay buffer, prompt loading and checkpoint contents), which verl keys on "sync"
        self.trainer_mode = "sync"
        return super()._build_replay_buffer()

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        for role in list(self.role_worker_mapping):
            if role in (Role.ActorRolloutRef, Role.ActorRollout, Role.Actor):
                self.role_worker_mapping[role] = ray.remote(ApertusActorRolloutRefWorker)

    def on_init_end(self) -> None:
        super().on_init_end()
        opts = OmegaConf.to_container(self.config.apertus, resolve=True)
        self.actor_rollout_wg.apertus_install_loss(self.stage, opts.get(self.stage, {}))
        self.chat_tokenizer = ChatTokenizer(self.config.actor_rollout_ref.model.get("tokenizer_path")
                                            or self.config.actor_rollout_ref.model.path)
        if self.uses_judge:
            if OmegaConf.is_missing(self.config.apertus.judge, "charter"):
                raise ValueError("apertus.judge.charter is not set: give the charter's text or "
                                 "apertus.judge.charter=@/path/to/charter.md ('@sample' is the sample charter for "
                                 "tests and demos)")
            judge_cfg = dict(opts["judge"])
            self.judge = make_judge(judge_cfg.pop("backend", "openai"), **judge_cfg)
            self.judge.check()  # fail at start, not after the first rollout, when the judge is down

    def _sample(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        """This step's rollouts from verl's replay buffer, timed as verl times generation."""
        with marked_timer("gen", timing_raw, color="red"):
            self.on_sample_begin()
            batch, off_policy_metrics = self.replay_buffer.sample(global_steps=self.global_steps,
                                                                  partition_id="train", batch_size=sample_batch_size)
            metrics.update(off_policy_metrics)
            self.on_sample_end()
        return batch

    def _texts(self, batch: KVBatchMeta) -> tuple[list[Any], list[str], list[str]]:
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["responses", "raw_prompt"])
        raw = [list(m) for m in data["raw_prompt"]]
        prompts = [next(m["content"] for m in reversed(msgs) if m.get("role") == "user") for msgs in raw]
        prompts = [p if isinstance(p, str) else " ".join(x.get("text", "") for x in p) for p in prompts]
        # the response the judge reads is the answer a reader sees (the one rule of rewards and evaluation)
        responses = [visible_answer(self.chat_tokenizer.decode(r.tolist())) for r in data["responses"].unbind()]
        return raw, prompts, responses

    def _check_rollout_sync(self, batch: KVBatchMeta, metrics: dict) -> None:
        """With ``apertus.check_rollout_sync``: verl's rollout-vs-actor metrics on this step's rollouts.

        The actor's log-probs of the rollout's tokens, before this step's update, against the
        rollout engine's (``rollout.calculate_log_probs``): verl's ``training/rollout_probs_diff_*``
        (``calculate_debug_metrics``, what verl's own PPO logs), near zero when the engine serves the
        weights synced after the last update. ``training/ref_probs_diff_max`` is the same distance from
        the actor to the frozen initial policy: what a rollout engine that never received an update
        would show. Costs an actor and a reference forward pass per step.
        """
        if not self.config.apertus.get("check_rollout_sync", False):
            return
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            raise ValueError("apertus.check_rollout_sync needs the rollout's log-probs: set "
                             "actor_rollout_ref.rollout.calculate_log_probs=true")
        from verl.utils.debug.metrics import calculate_debug_metrics
        from verl.workers.utils.padding import response_from_nested

        self._compute_ref_log_prob(batch, metrics={})
        batch.extra_info.update({"calculate_entropy": False, "compute_loss": False,
                                 "temperature": self.config.actor_rollout_ref.rollout.temperature})
        self.actor_rollout_wg.compute_log_prob(batch)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["log_probs", "response_mask", "responses", "rollout_log_probs",
                                              "ref_log_prob"])
        data["old_log_probs"] = response_from_nested(data.pop("log_probs"), data["response_mask"])
        padded = data.to_padded_tensor()
        metrics.update(calculate_debug_metrics(DataProto(batch=padded)))
        mask = padded["response_mask"].bool()
        shift = (padded["old_log_probs"].exp() - padded["ref_log_prob"].exp()).abs()[mask]
        metrics["training/ref_probs_diff_max"] = float(shift.max()) if shift.numel() else float("nan")

    def _compute_metrics(self, batch: KVBatchMeta, metrics: dict, timing_raw: dict, global_steps: int,
                         epoch: int) -> None:
        """The step's bookkeeping metrics, from the rows' tags (verl's PPO metrics read advantages,
        values and returns, which these stages never compute)."""
        # the truncation rate of the rollout stages (offline DPO generates nothing: its pairs are checked at load)
        cap = None if isinstance(self, OfflineDPOTrainer) else int(self.config.data.max_response_length)
        metrics.update(step_metrics(batch.tags, timing_raw, global_steps, epoch, self._get_n_gpus_for_throughput(),
                                    max_response_length=cap))

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
class SDPOTrainer(_ApertusTrainer, PPOTrainerSync):
    """SDPO: rollouts -> judge feedback -> teacher prompts -> top-k/tail reverse KL to the frozen teacher."""

    stage = "sdpo"

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        batch = self._sample(metrics, timing_raw, sample_batch_size)
        batch = self._balance_batch(batch, metrics=metrics)
        with marked_timer("old_log_prob", timing_raw, color="blue"):
            batch = self._compute_old_log_prob(batch, metrics=metrics)  # bypass mode: the rollout's log-probs
        with marked_timer("check_rollout_sync", timing_raw, color="blue"):
            self._check_rollout_sync(batch, metrics)
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
            # micro-batches: the actor's ppo_micro_batch_size_per_gpu (verl fills it in when the batch names none)
            self._update(batch, metrics, {"distillation_use_topk": True, "distillation_only": False})
        return batch


@register_trainer("apertus_online_dpo")
class OnlineDPOTrainer(_ApertusTrainer, PPOTrainerSync):
    """Online DPO: N rollouts per prompt -> judge ratings -> MaxMin pairs -> DPO against the reference."""

    stage = "online_dpo"

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        batch = self._sample(metrics, timing_raw, sample_batch_size)
        with marked_timer("check_rollout_sync", timing_raw, color="blue"):
            self._check_rollout_sync(batch, metrics)
        with marked_timer("judge", timing_raw, color="yellow"):
            _, prompts, responses = self._texts(batch)
            scores = dpo.judge_scores(self.judge, prompts, responses)
            uids = field_list(tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                              select_fields=["uid"])["uid"])
            pairs, pair_metrics = dpo.maxmin_pairs(uids, scores)
            metrics.update(pair_metrics)
            metrics["dpo/judge_score_mean"] = float(np.mean(scores))
        rows = [r for pair in pairs for r in pair]
        dp_size = max(self.actor_rollout_wg._query_dispatch_info("actor")) + 1
        actor = self.config.actor_rollout_ref.actor
        micro = 1 if actor.get("use_dynamic_bsz", False) else int(actor.get("ppo_micro_batch_size_per_gpu") or 1)
        unit = dp_size * micro  # every rank gets whole micro-batches of whole pairs
        n_pairs = (len(pairs) // unit) * unit
        if n_pairs == 0:
            raise RuntimeError(f"step {self.global_steps}: {len(pairs)} preference pairs (prompts whose responses the "
                               f"judge rated alike give none), fewer than {dp_size} data-parallel ranks x "
                               f"{micro} pairs per micro-batch; raise data.train_batch_size or rollout.n, or lower "
                               "actor.ppo_micro_batch_size_per_gpu")
        metrics["dpo/pairs_trained"] = float(n_pairs)
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


class NoRollout:
    """The agent-loop manager of a trainer that generates nothing (offline DPO).

    verl's task runner always builds an agent-loop manager; the offline config names this class
    (``actor_rollout_ref.rollout.agent.agent_loop_manager_class``) so no agent-loop workers start.
    """

    @classmethod
    def create(cls, **_: Any) -> NoRollout:
        return cls()

    def generate_sequences(self, prompts: Any) -> None:
        raise RuntimeError("offline DPO trains on a static pair file and generates nothing; validation by "
                           "generation is off (trainer.val_before_train=false, trainer.test_freq=-1)")


class NoRolloutReplica(RolloutReplica):
    """The rollout backend ``none`` (``actor_rollout_ref.rollout.name=none``): a replica that serves nothing.

    verl resolves the rollout backend's replica class even for a trainer without rollout servers
    (``LLMServerManager.create_empty``); with ``none`` that resolution imports no inference engine.
    No replica of it is ever created by the offline trainer; launching one is an error.
    """

    async def launch_servers(self) -> None:
        raise RuntimeError("rollout backend 'none' serves nothing: a trainer that generates needs "
                           "actor_rollout_ref.rollout.name=vllm (or another engine)")


RolloutReplicaRegistry.register("none", lambda: NoRolloutReplica)


@register_trainer("apertus_offline_dpo")
class OfflineDPOTrainer(_ApertusTrainer, PPOTrainer):
    """Offline DPO: a static pair file -> interleaved pair batches -> reference log-probs -> length-normalized DPO.

    No rollout servers start (``_enable_hybrid_replicas = False``: verl builds an actor worker group
    and a separate, colocated reference worker group). Each step takes ``data.train_batch_size``
    pairs from the file (shuffled per epoch with ``data.seed``), writes their rows to the
    TransferQueue in the layout of a rollout trajectory, balances whole pairs over the data-parallel
    ranks, runs verl's reference log-prob step and one actor update with ``force_group_size=2``.
    The pair order is a stateful data loader, saved with verl's checkpoints.
    """

    stage = "offline_dpo"
    uses_judge = False
    _enable_hybrid_replicas = False

    def _init_dataloader(self) -> None:
        from omegaconf import open_dict
        from torchdata.stateful_dataloader import StatefulDataLoader

        opts = self.config.apertus.offline_dpo
        records = dpo.load_pair_file(opts.pair_file)
        chat = ChatTokenizer(self.config.actor_rollout_ref.model.get("tokenizer_path")
                             or self.config.actor_rollout_ref.model.path)
        thinking = bool(self.config.data.get("apply_chat_template_kwargs", {}).get("enable_thinking", False))
        max_length = opts.get("max_length")
        self.train_dataset = dpo.encode_pairs(records, chat, int(self.config.data.max_prompt_length),
                                              int(self.config.data.max_response_length),
                                              max_length=None if max_length is None else int(max_length),
                                              enable_thinking=thinking,
                                              drop_overlong=bool(opts.get("drop_overlong", False)), progress=True)
        pairs_per_step = int(self.config.data.train_batch_size)
        if len(self.train_dataset) < pairs_per_step:
            raise ValueError(f"{opts.pair_file} holds {len(self.train_dataset)} usable pairs, fewer than one step's "
                             f"data.train_batch_size={pairs_per_step}")
        generator = torch.Generator().manual_seed(int(self.config.data.get("seed", 1)))
        self.train_dataloader = StatefulDataLoader(self.train_dataset, batch_size=pairs_per_step,
                                                   shuffle=bool(self.config.data.get("shuffle", True)),
                                                   generator=generator, drop_last=True, collate_fn=list)
        self.train_dataloader_it = None
        self.steps_per_epoch = len(self.train_dataloader)
        total = self.steps_per_epoch * int(self.config.trainer.total_epochs)
        if self.config.trainer.total_training_steps is not None:
            total = int(self.config.trainer.total_training_steps)
        self.total_training_steps = total
        with open_dict(self.config):  # the schedule's horizon, as verl sets it for its own trainers
            self.config.actor_rollout_ref.actor.optim.total_training_steps = total * self.parameter_sync_step
        logger.info("offline DPO: %d pairs, %d steps per epoch, %d steps", len(self.train_dataset),
                    self.steps_per_epoch, total)

    def _next_pairs(self) -> list[dpo.EncodedPair]:
        try:
            if self.train_dataloader_it is None:
                self.train_dataloader_it = iter(self.train_dataloader)
            return next(self.train_dataloader_it)
        except StopIteration:
            self.train_dataloader_it = iter(self.train_dataloader)
            return next(self.train_dataloader_it)

    def prepare_step(self) -> dict:
        return {}  # nothing to generate

    def on_sample_end(self) -> None:
        return None

    def on_step_end(self) -> None:
        return None  # no rollout replicas hold weights

    def _validate(self) -> dict[str, float]:
        raise RuntimeError("offline DPO has no generation validation: set trainer.val_before_train=false and "
                           "trainer.test_freq=-1 (the shipped apertus_offline_dpo config does)")

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        with marked_timer("data", timing_raw, color="red"):
            pairs = self._next_pairs()
            dp_size = max(self.actor_rollout_wg._query_dispatch_info("actor")) + 1
            fields, tags, keys = dpo.offline_step_rows(pairs, dp_size, step=self.global_steps)
            tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=tags)
            batch = rows_meta(keys, tags)
            metrics["dpo/pairs"] = float(len(pairs))
            metrics["dpo/tokens"] = float(sum(p.tokens for p in pairs))
        with marked_timer("ref", timing_raw, color="olive"):
            batch = self._compute_ref_log_prob(batch, metrics=metrics)
        with marked_timer("update_actor", timing_raw, color="red"):
            self._update(batch, metrics, {"force_group_size": dpo.PAIR_GROUP_SIZE})
        return batch


def rows_meta(keys: list[str], tags: list[dict[str, Any]], partition_id: str = "train") -> KVBatchMeta:
    """Metadata naming rows of the TransferQueue, without a field list (as verl's replay buffer samples them).

    The metadata that ``kv_batch_put`` returns lists the fields written by that call, and verl's
    TransferQueue bridge hands a worker only the listed fields: a batch carried on with it would never
    show the worker a field written later (the reference log-probs).
    """
    return KVBatchMeta(partition_id=partition_id, keys=list(keys), tags=list(tags))


def field_list(value: Any) -> list[Any]:
    """A non-tensor TransferQueue field (strings such as ``uid``) as a plain list.

    ``kv_batch_get`` returns such a field as tensordict's ``LinkedList`` (a ``list``, no ``tolist``),
    a ``NonTensorStack`` or a tensor, depending on how it was written.
    """
    if isinstance(value, list):
        return list(value)
    return list(value.tolist())


def truncation_ratio(response_lengths: Any, max_response_length: int) -> float:
    """The share of responses that reached the rollout cap ``data.max_response_length`` (truncated rollouts)."""
    lengths = np.asarray(response_lengths, dtype=float)
    if max_response_length <= 0:
        raise ValueError(f"data.max_response_length must be positive, got {max_response_length}")
    return float(np.mean(lengths >= max_response_length)) if lengths.size else float("nan")


def step_metrics(tags: list[dict[str, Any]], timing_raw: dict[str, float], global_steps: int, epoch: int,
                 n_gpus: int, max_response_length: int | None = None) -> dict[str, float]:
    """Step, epoch, timings, sequence lengths and throughput of a step, under verl's metric names.

    With ``max_response_length`` (the rollout cap) also verl's ``response_length/clip_ratio``: the share of
    the step's responses that reached the cap (truncated rollouts), as verl's PPO metrics compute it."""
    rows = [t for t in tags if not t.get("is_padding", False)] or list(tags)
    out: dict[str, float] = {"training/global_step": global_steps, "training/epoch": epoch}
    out.update({f"timing_s/{name}": float(value) for name, value in timing_raw.items()})
    for name, key in (("prompt_length", "prompt_len"), ("response_length", "response_len")):
        values = [float(t[key]) for t in rows if key in t]
        if values:
            out.update({f"{name}/mean": float(np.mean(values)), f"{name}/max": max(values), f"{name}/min": min(values)})
    responses = [float(t["response_len"]) for t in rows if "response_len" in t]
    if max_response_length is not None and responses:
        out["response_length/clip_ratio"] = truncation_ratio(responses, max_response_length)
    tokens = sum(int(t["seq_len"]) for t in rows)
    out["perf/total_num_tokens"] = float(tokens)
    if timing_raw.get("step"):
        out["perf/time_per_step"] = float(timing_raw["step"])
        out["perf/throughput"] = tokens / timing_raw["step"] / max(1, n_gpus)
    return out


def tq_fields(fields: dict[str, Any], batch_size: int) -> Any:
    from tensordict import TensorDict

    return TensorDict(fields, batch_size=batch_size)


class _CapTruncationRate:
    """verl 0.9's v1 trainers pad a step's responses to the step's longest before its PPO metrics, so verl's
    ``response_length/clip_ratio`` is the share of responses as long as the longest of the step (one in eight
    with a longest response of 172 tokens under a cap of 448, measured on CPU), not the share that reached
    ``data.max_response_length``. The RLVR modes below replace it with the share that reached the cap: the
    truncation rate, as the SDPO and online DPO trainers compute it (:func:`step_metrics`). Everything else is
    verl's mode of :attr:`verl_mode`, which verl's trainer sees as its ``trainer.v1.trainer_mode`` (verl keys
    its mode settings, ``trainer.v1.<mode>``, and its code paths on that name)."""

    verl_mode = ""

    def __init__(self, config: Any) -> None:
        from omegaconf import open_dict

        with open_dict(config):
            config.trainer.v1.trainer_mode = self.verl_mode
        super().__init__(config)  # type: ignore[call-arg]

    def _compute_metrics(self, batch: KVBatchMeta, metrics: dict, timing_raw: dict, global_steps: int,
                         epoch: int) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)  # type: ignore[misc]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["responses"])
        lengths = data["responses"].offsets().diff().tolist()
        real = [n for n, tag in zip(lengths, batch.tags, strict=True) if not tag.get("is_padding", False)]
        cap = int(self.config.data.max_response_length)  # type: ignore[attr-defined]
        metrics["response_length/clip_ratio"] = truncation_ratio(real or lengths, cap)


@register_trainer("apertus_colocate_async")
class RLVRColocateAsyncTrainer(_CapTruncationRate, PPOTrainerColocateAsync):
    """verl's ``colocate_async`` trainer (the RLVR preset) with the truncation rate against the response cap."""

    verl_mode = "colocate_async"


@register_trainer("apertus_separate_async")
class RLVRSeparateAsyncTrainer(_CapTruncationRate, PPOTrainerSeparateAsync):
    """verl's ``separate_async`` trainer (``+rlvr_async=separate``) with the truncation rate against the cap."""

    verl_mode = "separate_async"
