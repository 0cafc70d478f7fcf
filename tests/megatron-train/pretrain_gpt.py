"""A GPT pretraining script of the shape of Megatron-LM's ``pretrain_gpt.py`` for megatron-core 0.19.

Test code: the megatron-core 0.19 wheel packages ``megatron.training`` but not Megatron-LM's
scripts, so the suite carries a script of the same public shape (written here, not copied):
module-level ``train_valid_test_datasets_provider`` (with ``is_distributed``), ``forward_step``
and ``loss_func`` over megatron-core's ``GPTDataset``, and a ``__main__`` block that does what
0.19's does::

    args = parse_and_validate_args(extra_args_provider=..., args_defaults=...)
    model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)

Run as ``python pretrain_gpt.py ...`` it trains megatron-core's stock GPT; run through
``apertus-megatron pretrain_gpt.py ... --apertus-...`` the plugin swaps in the Apertus spec, data
and loss (the launcher relies on nothing but this shape).
"""

from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """The micro-batch, read on the first tensor-parallel rank and broadcast to the others."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {k: (data[k].to(device) if data.get(k) is not None else None) for k in KEYS}
    else:
        b, s = args.micro_batch_size, args.seq_length
        shapes = {"attention_mask": (b, 1, s, s)}
        dtypes = {"loss_mask": torch.float32, "attention_mask": torch.bool}
        batch = {k: torch.empty(shapes.get(k, (b, s)), dtype=dtypes.get(k, torch.int64), device=device)
                 for k in KEYS}
        if not args.create_attention_mask_in_dataloader:
            batch["attention_mask"] = None
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        for k in KEYS:
            if batch[k] is not None:
                torch.distributed.broadcast(batch[k], src, group=group)
    return tuple(batch[k] for k in KEYS)


def loss_func(loss_mask, output_tensor, model=None):
    """Summed masked loss, its token count, and the ``lm loss`` report (megatron-core's three outputs)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan=False):
    """One forward pass: the model's per-token losses and the loss function bound to the batch's mask."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask, model=model)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


def core_gpt_dataset_config_from_args(args):
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Train, validation and test ``GPTDataset`` blends (``MockGPTDataset`` with ``--mock-data``)."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples,
                                             partial(is_dataset_built_on_rank, vp_stage=vp_stage),
                                             core_gpt_dataset_config_from_args(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
