"""The batch, forward step, loss function, model provider and dataset provider of an Apertus run.

These are what the launcher passes to Megatron-LM's ``pretrain`` in place of ``pretrain_gpt.py``'s
own, through ``pretrain``'s parameters, with the same signatures:

* :func:`forward_step` ``(data_iterator, model, return_schedule_plan=False)`` reads a batch with
  :func:`get_batch` (which keeps the ``modality`` key upstream's drops) and returns the model's
  per-token losses with :func:`loss_func` bound to the batch.
* :func:`loss_func` weights each label by its keep mask (from the dataset: SFT mask, excluded ids,
  end of document, Goldfish) times its modality's weight at the current iteration (a preset,
  explicit weights or a schedule), and reports the combined loss (``lm loss``, the trained
  objective) with each modality's own loss (``text loss``, ``image loss``, ...) beside it, each
  over the same targets (the labels of positive weight) and token-weighted across micro-batches
  and ranks by Megatron's own reduction. Under context parallelism the trained loss is normalised
  by the target count of the whole sequence (summed over the CP group), so that a CP=N run
  trains and logs what the CP=1 run does. Nothing in it waits for the device.
* Context parallelism (``--context-parallel-size``) needs ``--apertus-packed-sequences``: each
  packed sample is split over the CP ranks as Transformer Engine's THD attention expects
  (:func:`batch_on_this_cp_rank`, the index math in :func:`apertus_plugins.core.packing.cp_partition_indices`):
  tokens, labels, loss mask, modality ids (and with them the Goldfish drops, part of the mask) and
  position ids alike.
* :class:`StepTargets` counts each step's targets (all, and per modality); the ``train_step``
  override (:mod:`megatron_patches.overrides`) reads the counts to skip a step whose global batch
  holds no target and to leave a modality without targets out of the step's losses.
* :func:`model_provider` builds the Apertus ``GPTModel`` (:mod:`megatron_patches.spec`) after the
  :func:`preflight`; it is ``pretrain``'s model provider with Megatron-LM 0.16 and the builder of
  :class:`~megatron_patches.model_builder.ApertusModelConfig` from 0.19.
* :func:`train_valid_test_datasets_provider` builds :class:`~megatron_patches.dataset.ApertusDataset`
  blends with megatron-core's ``BlendedMegatronDatasetBuilder``.
* :func:`preflight` fails before training on a corrupt or mismatched ``.bin``/``.idx`` pair, a
  prefix missing from the manifest, or a vocabulary that does not fit the embedding.

``megatron.training`` (Megatron-LM) is imported only inside the functions that need it: with
megatron-core 0.16 it is the user's checkout, which the launcher puts on the path.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state

from apertus_plugins.core.packing import cp_partition_indices
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.data.indexed import IndexedDataset, IndexedDatasetError
from apertus_plugins.data.manifest import read_manifest, verify_manifest

from .arguments import ApertusOptions, describe_options, options_from_args
from .errors import PreflightError
from .version import require_supported

# the version check follows the imports (import order): an unsupported megatron-core stops here with the
# supported range, before anything of this module is defined or run
require_supported()

__all__ = [
    "BATCH_KEYS",
    "StepTargets",
    "step_targets",
    "PreflightError",
    "set_options",
    "get_options",
    "modality_weights",
    "loss_func",
    "get_batch",
    "batch_on_this_cp_rank",
    "forward_step",
    "model_provider",
    "dataset_config_from_args",
    "train_valid_test_datasets_provider",
    "data_prefixes",
    "preflight",
]

#: Per-token keys every batch carries (``[micro_batch, seq_length]``).
BATCH_KEYS = ("tokens", "labels", "loss_mask", "modality", "position_ids")
_OPTIONS: list[ApertusOptions] = []


def set_options(options: ApertusOptions) -> None:
    """Make ``options`` the run's Apertus options."""
    _OPTIONS[:] = [options]


def get_options(args: Any = None) -> ApertusOptions:
    """The run's options, built once from Megatron's parsed arguments (``args``, else ``get_args()``).

    The first build prints what the plugin does in this run (rank 0) and refuses ``--mock-data``.
    With Megatron-LM 0.19 the ``parse_and_validate_args`` override builds them right after parsing;
    with 0.16 the model provider does, the first plugin code ``pretrain`` runs.
    """
    if not _OPTIONS:
        if args is None:
            from megatron.training import get_args

            args = get_args()
        options = options_from_args(args)
        if getattr(args, "mock_data", False):
            raise PreflightError("--mock-data is not supported with apertus-megatron (the Apertus targets need real "
                                 "indexed datasets)")
        if os.environ.get("RANK", "0") == "0":
            print(f" [apertus] {describe_options(options)}", flush=True)
        set_options(options)
    return _OPTIONS[0]


def modality_weights(options: ApertusOptions, step: float | None, device: torch.device | None = None) -> torch.Tensor:
    """float32 weight per modality (``spec.modality_names`` order) at iteration ``step``.

    With ``device`` the tensor is copied there once per distinct set of values and reused (the
    weights change only with a schedule), so the loss path makes no host-to-device copy per micro-batch.
    """
    values = options.targets.weights_at(options.spec, step)
    if device is None:
        return torch.from_numpy(values)
    key = (str(device), values.tobytes())
    hit = _WEIGHTS.get(key)
    if hit is None:
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        hit = _WEIGHTS[key] = torch.from_numpy(values).to(device)
    return hit


_WEIGHTS: dict[tuple[str, bytes], torch.Tensor] = {}


# ------------------------------------------------------------------------------------------ loss
def loss_func(
    loss_mask: torch.Tensor,
    modality: torch.Tensor,
    output_tensor: torch.Tensor,
    *,
    weights: torch.Tensor,
    names: Sequence[str],
    model: Any = None,
    validate: Any = None,
    cp_group: Any = None,
    per_token_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The Apertus loss of one micro-batch, in megatron-core's three-output form.

    Args:
        loss_mask: ``[b, s]`` keep mask of each label (1 = a target) from the dataset.
        modality: ``[b, s]`` modality index of each label.
        output_tensor: ``[b, s]`` per-token cross-entropy from ``GPTModel`` (given ``labels``).
        weights: ``[M]`` loss weight of each modality at this iteration.
        names: the ``M`` modality names (``spec.modality_names``).
        model: unused (upstream's signature).
        validate: optional ``callable(loss)`` for NaN/Inf/spike checks (on this rank's own sum).
        cp_group: the context-parallel group when it has more than one rank (this rank's labels are
            a slice of the sequence).
        per_token_loss: Megatron's ``--calculate-per-token-loss`` (it then divides the gradients by
            the global target count itself).

    Returns:
        ``(loss, number of targets, report)``. Megatron divides the loss by the count (without
        ``--calculate-per-token-loss``) and averages the gradients over the data- and
        context-parallel ranks. On one CP rank that is ``sum_j w_j * loss_j`` and the rank's
        target count, where ``w_j`` is the keep mask times the modality weight and the targets
        are the labels with ``w_j > 0``. Under context parallelism (without per-token loss) the
        count is the whole sequence's (summed over the CP group) and the sum is multiplied by the
        CP size, so the averaged gradient is that of the whole sequence's mean, exactly as at
        CP=1 (megatron-core would average the CP ranks' own means instead). The report holds
        ``[sum, count]`` pairs over this rank's targets: ``lm loss`` (the trained, weighted loss)
        and ``<modality> loss`` for each modality (its unweighted mean loss over its targets).
        Megatron sums each pair over the micro-batches and the data- and context-parallel ranks
        of a step before it divides, so every logged value is token-weighted and equals the
        CP=1 value. The target counts also go to :func:`step_targets` (the launcher's check for
        steps without targets). No value is read back to the host here.
    """
    losses = output_tensor.reshape(-1).float()
    keep = loss_mask.reshape(-1).float()
    mod = modality.reshape(-1).long()
    w = keep * weights.to(device=losses.device, dtype=torch.float32)[mod]
    loss = torch.sum(losses * w)
    target = w > 0
    num_tokens = target.sum()
    # every modality's sum and count in one masked [tokens, M] reduction (deterministic, no host sync)
    onehot = (mod.unsqueeze(1) == torch.arange(len(names), device=mod.device)) & target.unsqueeze(1)
    sums = (losses.detach().unsqueeze(1) * onehot).sum(dim=0)
    counts = onehot.sum(dim=0)
    report = {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}
    for k, name in enumerate(names):
        report[f"{name} loss"] = torch.stack([sums[k], counts[k].float()])
    _STEP.add(torch.cat([num_tokens.view(1), counts]).to(torch.int64))
    if validate is not None:
        validate(loss)
    if cp_group is not None and not per_token_loss:
        cp_size = torch.distributed.get_world_size(cp_group)
        if cp_size > 1:
            num_tokens = num_tokens.clone()
            torch.distributed.all_reduce(num_tokens, group=cp_group)
            loss = loss * cp_size
    return loss, num_tokens.to(torch.int), report


# ------------------------------------------------------------------------------- steps without targets
@dataclasses.dataclass
class StepTargets:
    """Target counts of the current training step, and how many steps so far had none.

    :func:`loss_func` adds each micro-batch's counts (``[all, per modality...]``) on this rank;
    :meth:`reduce` sums them over every rank once the step's backward passes are done (the
    tensor-parallel ranks of a group see the same labels, so the sum is divided by their number).
    """

    local: torch.Tensor | None = None
    total: list[int] | None = None
    empty_steps: int = 0

    def reset(self) -> None:
        self.local, self.total = None, None

    def add(self, counts: torch.Tensor) -> None:
        self.local = counts if self.local is None else self.local + counts.to(self.local.device)

    def reduce(self, size: int) -> list[int]:
        counts = torch.zeros(size, dtype=torch.int64, device=_device()) if self.local is None else \
            self.local.to(_device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
            if parallel_state.model_parallel_is_initialized():
                counts = counts // max(1, parallel_state.get_tensor_model_parallel_world_size())
        self.total = [int(c) for c in counts.tolist()]
        return self.total


_STEP = StepTargets()


def step_targets() -> StepTargets:
    """The target accounting of this process (see :class:`StepTargets`)."""
    return _STEP


def _megatron_validate(loss: torch.Tensor) -> None:
    """Upstream's checks of ``pretrain_gpt.loss_func``: NaN/Inf (fatal) and spiky loss, per the run's flags."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    rsm = get_rerun_state_machine()
    if getattr(args, "check_for_nan_in_loss_and_grad", False):
        rsm.validate_result(result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss "
                            "calculation", tolerance=0.0, fatal=True)
        rsm.validate_result(result=loss, rejection_func=torch.isinf, message="found Inf in local forward loss "
                            "calculation", tolerance=0.0, fatal=True)
    if getattr(args, "check_for_spiky_loss", False):
        rsm.validate_result(result=loss, rejection_func=partial(rsm.is_unexpectedly_large, threshold=10,
                                                                 context="loss"),
                            message="Spiky loss", tolerance=0.0, fatal=False)


# ------------------------------------------------------------------------------------------ batch
def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def get_batch(
    data_iterator: Iterator[dict[str, torch.Tensor]] | None,
    *,
    micro_batch_size: int,
    seq_length: int,
    attention_mask: bool,
    packed_sequences: bool,
    is_first_stage: bool = True,
    is_last_stage: bool = True,
    tp_group: Any = None,
) -> dict[str, torch.Tensor | None]:
    """One micro-batch as a dict of tensors on this rank's device, the same on every tensor-parallel rank.

    The first rank of the tensor-parallel group reads ``data_iterator`` and broadcasts
    :data:`BATCH_KEYS` (plus ``attention_mask`` / ``cu_seqlens`` and ``max_seqlen`` when used);
    the others allocate and receive. Stages in the middle of a pipeline get only what attention
    needs (``attention_mask``, ``cu_seqlens``), as their layers still separate documents. With
    packed sequences the batch also holds ``cu_seqlens_host``, the boundaries on the host (the
    loader's own tensor on the reading rank), for the index math of context parallelism.
    """
    dev = _device()
    tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    tp_size = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
    src = torch.distributed.get_global_rank(tp_group, 0) if tp_size > 1 else 0
    ends = is_first_stage or is_last_stage
    keys = [k for k in BATCH_KEYS if ends]
    if attention_mask:
        keys.append("attention_mask")
    batch: dict[str, torch.Tensor | None] = {k: None for k in (*BATCH_KEYS, "attention_mask", "cu_seqlens",
                                                                "max_seqlen")}
    if tp_rank == 0:
        if data_iterator is None:
            raise RuntimeError("get_batch: this rank has no data iterator")
        data = next(data_iterator)
        for k in keys + (["cu_seqlens", "max_seqlen"] if packed_sequences else []):
            if k not in data:
                raise KeyError(f"the batch has no {k!r}: build the data with megatron_patches.dataset.ApertusDataset")
            batch[k] = data[k].to(dev, non_blocking=True)
        if packed_sequences:
            batch["cu_seqlens_host"] = data["cu_seqlens"].cpu()
    if tp_size > 1:
        shapes = {"attention_mask": (micro_batch_size, 1, seq_length, seq_length)}
        dtypes = {"loss_mask": torch.float32, "attention_mask": torch.bool}
        for k in keys:
            if tp_rank != 0:
                batch[k] = torch.empty(shapes.get(k, (micro_batch_size, seq_length)),
                                       dtype=dtypes.get(k, torch.int64), device=dev)
            torch.distributed.broadcast(batch[k], src, group=tp_group)
        if packed_sequences:
            n = torch.tensor([0 if tp_rank else batch["cu_seqlens"].numel()], dtype=torch.int64, device=dev)
            torch.distributed.broadcast(n, src, group=tp_group)
            if tp_rank != 0:
                batch["cu_seqlens"] = torch.empty((1, int(n.item())), dtype=torch.int32, device=dev)
                batch["max_seqlen"] = torch.empty((1,), dtype=torch.int32, device=dev)
            torch.distributed.broadcast(batch["cu_seqlens"], src, group=tp_group)
            torch.distributed.broadcast(batch["max_seqlen"], src, group=tp_group)
            if tp_rank != 0:
                batch["cu_seqlens_host"] = batch["cu_seqlens"].cpu()
    return batch


#: Per-token keys that context parallelism splits along the sequence.
CP_SPLIT_KEYS = ("tokens", "labels", "loss_mask", "modality", "position_ids")


def batch_on_this_cp_rank(batch: dict[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """This context-parallel rank's part of a packed micro-batch (``--apertus-packed-sequences``).

    Every document of the sample (its ``cu_seqlens`` segment, padded by the dataset to a multiple
    of ``2 x cp_size``) is cut into ``2 x cp_size`` chunks and the rank keeps chunks ``cp_rank``
    and ``2 x cp_size - 1 - cp_rank``: Transformer Engine's ``thd_get_partitioned_indices``, the
    split its THD attention and megatron-core's THD RoPE assume. Each of :data:`CP_SPLIT_KEYS`
    present is sliced with the same indices, so labels, loss mask (with the Goldfish drops),
    modality ids and position ids stay aligned with the tokens. ``cu_seqlens`` and ``max_seqlen``
    stay whole (the attention reads the global layout).
    """
    if cp_size == 1:
        return batch
    cu = batch.get("cu_seqlens_host")
    if cu is None:
        cu = batch["cu_seqlens"].cpu()
    cu = cu.reshape(-1, cu.shape[-1])
    if cu.shape[0] != 1:
        raise ValueError("--apertus-packed-sequences needs --micro-batch-size 1")
    index = torch.from_numpy(cp_partition_indices(cu[0].numpy(), cp_size, cp_rank))
    out = dict(batch)
    for key in CP_SPLIT_KEYS:
        value = out.get(key)
        if value is not None:
            out[key] = value.index_select(1, index.to(value.device, non_blocking=True))
    return out


def _packed_seq_params(batch: dict[str, Any]) -> Any:
    """``PackedSeqParams`` (THD) of a packed micro-batch: its document boundaries, padding included.

    The dataset counts each document's padding in its segment (megatron-core's SFT convention), so
    the plain and the ``_padded`` boundaries are the same tensor; ``max_seqlen`` is the longest
    segment, read on the host.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"]
    if cu.dim() == 2:
        if cu.shape[0] != 1:
            raise ValueError("--apertus-packed-sequences needs --micro-batch-size 1")
        cu = cu[0]
    host = batch.get("cu_seqlens_host")
    if host is not None:
        max_len = int((host.reshape(-1)[1:] - host.reshape(-1)[:-1]).max())
    else:
        max_len = int(batch["max_seqlen"].reshape(-1)[0].item())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len)


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]] | None, model: Any,
                 return_schedule_plan: bool = False) -> tuple[Any, Any]:
    """Megatron's forward step for Apertus: the batch, the model's per-token losses, :func:`loss_func` bound."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args, get_timers

    args = get_args()
    options = get_options()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    packed_sequences = options.packing.packed_sequences
    batch = get_batch(data_iterator, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                      attention_mask=bool(args.create_attention_mask_in_dataloader) and not packed_sequences,
                      packed_sequences=packed_sequences, is_first_stage=first, is_last_stage=last)
    cp_size = parallel_state.get_context_parallel_world_size()
    packed = None
    if packed_sequences:
        packed = _packed_seq_params(batch)
        batch = batch_on_this_cp_rank(batch, cp_size, parallel_state.get_context_parallel_rank())
    elif cp_size > 1:
        raise PreflightError("--context-parallel-size > 1 needs --apertus-packed-sequences (documents are kept apart "
                             "by cu_seqlens, split over the ranks as Transformer Engine expects)")
    timers("batch-generator").stop()
    if return_schedule_plan:
        raise NotImplementedError("apertus-megatron does not support --overlap-moe-expert-parallel-comm")
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"], packed_seq_params=packed)
    step = getattr(args, "curr_iteration", None)
    device = batch["loss_mask"].device if batch.get("loss_mask") is not None else None
    weights = modality_weights(options, step if step is not None else getattr(args, "iteration", 0), device)
    cp_group = parallel_state.get_context_parallel_group() if cp_size > 1 else None
    return output, partial(loss_func, batch["loss_mask"], batch["modality"], weights=weights,
                           names=options.spec.modality_names, model=model, validate=_megatron_validate,
                           cp_group=cp_group, per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)))


# ------------------------------------------------------------------------------------------ model
def embedding_rows(args: Any, options: ApertusOptions) -> int:
    """Rows of the embedding and output layer: Megatron's padded vocabulary size.

    ``--apertus-embedding-rows N`` is Megatron's own ``--padded-vocab-size N`` (the released model:
    266752 rows); without either, Megatron pads the tokenizer's vocabulary.
    """
    rows = getattr(args, "padded_vocab_size", None) or options.embedding_rows
    if rows is None:
        raise PreflightError("the embedding size is unknown: Megatron set no padded_vocab_size; pass "
                             "--apertus-embedding-rows")
    return int(rows)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: Any = None, pg_collection: Any = None) -> Any:
    """Megatron's model provider for Apertus (runs :func:`preflight` first, once per job).

    ``pretrain``'s model provider with Megatron-LM 0.16; from 0.19 the builder of
    :class:`~megatron_patches.model_builder.ApertusModelConfig` calls it with the container's
    transformer config (``config``) and process groups.
    """
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from .spec import build_gpt_model

    args = get_args()
    options = get_options()
    preflight_from_args(args, options)
    rows = embedding_rows(args, options)
    if config is None:
        config = core_transformer_config_from_args(args)
    kwargs: dict[str, Any] = {"vp_stage": vp_stage}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    return build_gpt_model(
        config, vocab_size=rows, max_sequence_length=args.max_position_embeddings, rotary_base=args.rotary_base,
        rope_scaling=bool(args.use_rope_scaling), rope_scaling_factor=float(args.rope_scaling_factor),
        use_transformer_engine=args.transformer_impl == "transformer_engine", pre_process=pre_process,
        post_process=post_process, **kwargs)


# ------------------------------------------------------------------------------------------ data
def dataset_config_from_args(args: Any, options: ApertusOptions, tokenizer: Any) -> Any:
    """An :class:`~megatron_patches.dataset.ApertusDatasetConfig` from Megatron's data arguments."""
    from megatron.training.utils import get_blend_and_blend_per_split

    from .dataset import ApertusDatasetConfig

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    values = {
        "random_seed": args.seed,
        "sequence_length": args.seq_length,
        "blend": blend,
        "blend_per_split": blend_per_split,
        "split": args.split,
        "multiple_validation_sets": getattr(args, "multiple_validation_sets", None),
        "full_validation": getattr(args, "full_validation", None),
        "num_dataset_builder_threads": getattr(args, "num_dataset_builder_threads", 1),
        "path_to_cache": args.data_cache_path,
        "mmap_bin_files": args.mmap_bin_files,
        "tokenizer": tokenizer,
        "create_attention_mask": bool(args.create_attention_mask_in_dataloader),
        "mid_level_dataset_surplus": getattr(args, "mid_level_dataset_surplus", 0.005),
        "object_storage_cache_path": getattr(args, "object_storage_cache_path", None),
        "context_parallel_size": getattr(args, "context_parallel_size", 1),
        "data_parallel_size": getattr(args, "data_parallel_size", 1),
    }
    fields = {f.name for f in dataclasses.fields(ApertusDatasetConfig) if f.init}
    return ApertusDatasetConfig(**{k: v for k, v in values.items() if k in fields}, apertus=options)


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None) -> Any:
    """Megatron's dataset provider: ``ApertusDataset`` blends from ``--data-path`` and friends."""
    from megatron.training import get_args, get_tokenizer, print_rank_0

    from .dataset import build_datasets

    args = get_args()
    options = get_options()
    config = dataset_config_from_args(args, options, get_tokenizer())
    needs_all_stages = options.packing.packed_sequences or bool(args.create_attention_mask_in_dataloader)

    def is_built_on_rank() -> bool:
        if parallel_state.get_tensor_model_parallel_rank() != 0:
            return False
        if needs_all_stages:
            return True
        return parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) or \
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)

    print_rank_0("> building Apertus train, validation and test datasets ...")
    datasets = build_datasets(config, train_val_test_num_samples, is_built_on_rank)
    print_rank_0("> finished creating Apertus datasets")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ preflight
def data_prefixes(blend: Any, blend_per_split: Any) -> list[str]:
    """Every prefix of a megatron-core blend (``(prefixes, weights)``) and per-split blends, in order, once."""
    out: list[str] = []
    blends = [blend] + list(blend_per_split or [])
    for b in blends:
        if not b:
            continue
        for p in b[0]:
            if p not in out:
                out.append(p)
    return out


def preflight(options: ApertusOptions, prefixes: Iterable[str], *, embedding_rows: int,
              spec: VocabSpec | None = None) -> None:
    """Check a run's data and vocabulary before training; raise :class:`PreflightError` naming each problem.

    * the vocabulary fits the embedding (``VocabSpec.check_embedding``);
    * every ``--apertus-sft-data`` and ``--apertus-bfd-data`` prefix is part of the blend;
    * with packed documents padded for context parallelism, every prefix is a packed one
      (``--apertus-sft-data`` or ``--apertus-bfd-data``): Megatron's concatenated samples cannot be
      split per document;
    * every ``.bin``/``.idx`` pair (and stored SFT mask stream) reads consistently;
    * with ``--apertus-manifest``: the blend (with the mask streams) is exactly the manifest's list,
      with unchanged sizes and counts (and checksums with ``--apertus-manifest-checksums``).
    """
    spec = spec or options.spec
    prefixes = [os.path.normpath(p) for p in prefixes]
    problems: list[str] = []
    try:
        spec.check_embedding(embedding_rows, "embedding")
    except ValueError as exc:
        problems.append(f"vocabulary: {exc}")
    packing = options.packing
    for flag, listed in (("--apertus-sft-data", packing.sft_prefixes), ("--apertus-bfd-data", packing.bfd_prefixes)):
        for p in listed:
            if p not in prefixes:
                problems.append(f"{flag} {p}: not one of the run's data prefixes {prefixes}")
    if packing.padded:
        for p in prefixes:
            if not (packing.is_sft(p) or packing.is_bfd(p)):
                problems.append(f"{p}: packed documents are padded to multiples of {packing.pad_multiple} (context "
                                "parallelism), so every prefix must be packed: name it in --apertus-bfd-data "
                                "(pretraining documents) or --apertus-sft-data (conversations)")
    checked = list(prefixes)
    if options.sft_mask == "stored":
        checked += [p + options.sft_mask_suffix for p in packing.sft_prefixes if p in prefixes]
    for p in checked:
        try:
            ds = IndexedDataset(p)
        except (IndexedDatasetError, OSError) as exc:
            problems.append(f"{p}: {exc}")
            continue
        if p in prefixes and ds.num_tokens == 0:
            problems.append(f"{p}: the dataset holds no tokens")
    if options.sft_mask == "stored":
        for p in packing.sft_prefixes:
            if p not in prefixes:
                continue
            try:
                a, b = IndexedDataset(p), IndexedDataset(p + options.sft_mask_suffix)
            except (IndexedDatasetError, OSError):
                continue  # reported above
            if a.sequence_lengths.tolist() != b.sequence_lengths.tolist():
                problems.append(f"{p}{options.sft_mask_suffix}: the mask stream's sequence lengths differ from "
                                f"{p}'s")
    if options.manifest is not None:
        try:
            # a manifest may list the mask streams of the SFT prefixes although this run derives the mask
            listed = {os.path.normpath(e.get("prefix", "")) for e in read_manifest(options.manifest)["datasets"]}
            checked += [m for m in (p + options.sft_mask_suffix for p in packing.sft_prefixes if p in prefixes)
                        if m in listed and m not in checked]
            verify_manifest(options.manifest, checked, checksums=options.manifest_checksums)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise PreflightError("the run cannot start:\n  " + "\n  ".join(problems))


_PREFLIGHT_DONE: list[bool] = []


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def preflight_from_args(args: Any, options: ApertusOptions) -> None:
    """:func:`preflight` with the prefixes and embedding size of Megatron's parsed arguments, once per job.

    With a process group, rank 0 alone reads the data, the manifest and the checkpoint's
    arguments, and broadcasts its verdict; every other rank waits for it and raises the same
    :class:`PreflightError`. Without one (a single process), it runs here.
    """
    if _PREFLIGHT_DONE:
        return
    import time

    distributed = torch.distributed.is_initialized()
    verdict: str | None = None
    if _is_rank0():
        t0 = time.perf_counter()
        try:
            n = _preflight_checks(args, options)
        except PreflightError as exc:
            verdict = str(exc)
        else:
            how = "sizes, counts and sha256" if options.manifest_checksums else "sizes and counts"
            manifest = f", manifest {options.manifest} verified ({how})" if options.manifest else ""
            ranks = torch.distributed.get_world_size() if distributed else 1
            print(f" [apertus] preflight: {n} dataset prefixes checked{manifest} in {time.perf_counter() - t0:.2f} s "
                  f"on rank 0; verdict sent to {ranks} rank(s)", flush=True)
    if distributed:
        box = [verdict]
        torch.distributed.broadcast_object_list(box, src=0)
        verdict = box[0]
    _PREFLIGHT_DONE.append(True)
    if verdict is not None:
        raise PreflightError(verdict)


def _preflight_checks(args: Any, options: ApertusOptions) -> int:
    from megatron.training.utils import get_blend_and_blend_per_split

    if getattr(args, "mock_data", False):
        prefixes: list[str] = []
    else:
        prefixes = data_prefixes(*get_blend_and_blend_per_split(args))
    problems = cross_document_problems(args, options)
    if problems:
        raise PreflightError("documents would attend to each other:\n  " + "\n  ".join(problems))
    if not options.allow_rope_change:
        from .checkpoint import read_checkpoint_args, rope_differences

        # what Megatron loads: --load's checkpoint, else --pretrained-checkpoint's (a new stage's start)
        saved, load = None, None
        for candidate in (getattr(args, "load", None), getattr(args, "pretrained_checkpoint", None)):
            if candidate and saved is None:
                saved, load = read_checkpoint_args(candidate), candidate
        changed = rope_differences(saved, args) if saved is not None else []
        if changed:
            raise PreflightError(f"{load}: the RoPE settings differ from the checkpoint's ({'; '.join(changed)}); "
                                 "pass the checkpoint's values, or --apertus-allow-rope-change for a deliberate "
                                 "change (context extension)")
    preflight(options, prefixes, embedding_rows=embedding_rows(args, options))
    return len(prefixes)


def cross_document_problems(args: Any, options: ApertusOptions) -> list[str]:
    """Settings under which the attention would ignore the document boundaries of packed samples.

    Cross-document masking needs either packed sequences (``cu_seqlens``, Transformer Engine) or
    the dataloader's attention mask reaching an attention that applies it: Transformer Engine's
    causal attention and megatron-core's fused causal softmax ignore an explicit mask.
    """
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if options.packing.packed_sequences:
        if getattr(args, "micro_batch_size", 1) != 1:
            return ["--apertus-packed-sequences needs --micro-batch-size 1"]
        return []
    if cp > 1:
        return [f"--context-parallel-size {cp} splits every sample over {cp} ranks, where an [S, S] attention mask "
                "cannot keep documents apart: pass --apertus-packed-sequences (cu_seqlens; each document split as "
                "Transformer Engine's THD attention expects)"]
    problems = []
    if not getattr(args, "create_attention_mask_in_dataloader", True):
        problems.append("--no-create-attention-mask-in-dataloader: pass --apertus-packed-sequences instead")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        problems.append("Transformer Engine's causal attention ignores the attention mask: pass "
                        "--apertus-packed-sequences (cu_seqlens) or --transformer-impl local")
    elif getattr(args, "masked_softmax_fusion", False):
        problems.append("the fused causal softmax ignores the attention mask: pass --no-masked-softmax-fusion")
    return problems
