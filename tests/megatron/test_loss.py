"""The Apertus loss function on hand-made batches, against the core.

The dataset delivers the step-independent keep mask (excluded ids, the end-of-document rule,
Goldfish, or the SFT mask) and each label's modality; the loss multiplies in the modality weights
at the current iteration. Their product must equal the core's ``pretraining_targets`` for every
preset, with Goldfish on and off, with explicit and scheduled weights; the report must hold the
combined loss and each modality's own loss. ``get_batch`` keeps the ``modality`` key.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CONVERSATIONS, encode_conversations, write_pretraining_prefix

from apertus_plugins.core.targets import pretraining_targets, sft_mask
from apertus_plugins.core.vocab import VocabSpec
from megatron_patches.arguments import add_apertus_args, options_from_args
from megatron_patches.training import get_batch, loss_func, modality_weights, step_targets


def options(tokenizer_dir: Path, *extra: str) -> Any:
    parser = add_apertus_args(argparse.ArgumentParser())
    return options_from_args(parser.parse_args(["--apertus-tokenizer", str(tokenizer_dir), *extra]))


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory, spec: VocabSpec) -> np.ndarray:
    """Two rows of 200 tokens cut from documents of every modality (as GPTDataset cuts them)."""
    docs = write_pretraining_prefix(tmp_path_factory.mktemp("b") / "p", spec, n_docs=30, seed=5)
    flat = np.concatenate(docs)
    return np.stack([flat[:201], flat[300:501]])


PRESETS = [
    ("all", ()),
    ("text-only", ()),
    ("all", ("--apertus-goldfish-k", "3", "--apertus-goldfish-h", "4")),
    ("text-only", ("--apertus-goldfish-k", "3", "--apertus-goldfish-h", "4", "--apertus-goldfish-variant",
                   "order-sensitive")),
    ("all", ("--apertus-modality-weight", "image=0.25", "--apertus-modality-weight", "audio=0:1,100:0",
             "--apertus-exclude-tokens", "img_start", "--apertus-exclude-ids", "100", "101")),
    ("text-only", ("--apertus-no-eod-exclusion",)),
]


@pytest.mark.parametrize("preset,extra", PRESETS)
@pytest.mark.parametrize("step", [0, 40])
def test_loss_equals_core_targets(batch: np.ndarray, tokenizer_dir: Path, spec: VocabSpec, preset: str,
                                  extra: tuple[str, ...], step: int) -> None:
    opts = options(tokenizer_dir, "--apertus-targets", preset, *extra)
    # what the dataset delivers (the step-independent part), then the loss
    keep_cfg = replace(opts.targets, modality_weights={})
    keep = pretraining_targets(batch, spec, keep_cfg, goldfish=opts.goldfish).weights > 0
    labels = batch[:, 1:]
    modality = spec.modality_of(labels)
    losses = torch.rand(labels.shape, generator=torch.Generator().manual_seed(step)) * 5
    loss, n, report = loss_func(torch.from_numpy(keep.astype(np.float32)), torch.from_numpy(modality.astype(np.int64)),
                                losses, weights=modality_weights(opts, step), names=spec.modality_names)
    # the core, in one call with the real configuration at this step
    want_w = pretraining_targets(batch, spec, opts.targets, step=step, goldfish=opts.goldfish).weights
    want_w = torch.from_numpy(want_w)
    assert torch.allclose(loss, (losses * want_w).sum(), rtol=1e-6)
    assert int(n) == int((want_w > 0).sum())
    assert torch.allclose(report["lm loss"], torch.stack([(losses * want_w).sum(), (want_w > 0).sum().float()]))
    # each modality's loss is over the same targets as the trained loss (positive weight), unweighted
    for k, name in enumerate(spec.modality_names):
        sel = ((want_w > 0) & torch.from_numpy(modality == k)).float()
        got = report[f"{name} loss"]
        assert torch.allclose(got, torch.stack([(losses * sel).sum(), sel.sum()]))
    assert sum(int(report[f"{m} loss"][1]) for m in spec.modality_names) == int(n)
    if preset == "text-only":
        # weight 0: not a target, so not in the image loss either; the omni markers are no target from stage 2 on
        assert float(report["image loss"][1]) == 0 and float(report["omni loss"][1]) == 0
        assert int(n) == int((torch.from_numpy(keep) & torch.from_numpy(modality == 0)).sum())
    if preset == "all" and not extra:  # every modality weighs 1: the keep mask is the whole target
        assert torch.equal(want_w > 0, torch.from_numpy(keep))


def test_goldfish_drops_targets(batch: np.ndarray, tokenizer_dir: Path, spec: VocabSpec) -> None:
    off = options(tokenizer_dir)
    on = options(tokenizer_dir, "--apertus-goldfish-k", "3", "--apertus-goldfish-h", "4")
    k_off = pretraining_targets(batch, spec, replace(off.targets, modality_weights={})).weights > 0
    k_on = pretraining_targets(batch, spec, replace(on.targets, modality_weights={}), goldfish=on.goldfish).weights > 0
    assert (k_on <= k_off).all() and k_on.sum() < k_off.sum()
    # the exempt set: special ids (the omni markers among them) never drop
    labels = batch[:, 1:]
    special = np.isin(labels, sorted(spec.special_ids))
    assert (k_on[special] == k_off[special]).all()


def test_sft_batch(tokenizer_dir: Path, spec: VocabSpec) -> None:
    opts = options(tokenizer_dir)
    conv = encode_conversations(tokenizer_dir, CONVERSATIONS[1:2])[0]
    keep = sft_mask(conv, spec)
    labels = conv[1:]
    losses = torch.linspace(0.1, 3.0, labels.size)[None]
    loss, n, report = loss_func(torch.from_numpy(keep.astype(np.float32))[None],
                                torch.from_numpy(spec.modality_of(labels).astype(np.int64))[None], losses,
                                weights=modality_weights(opts, 0), names=spec.modality_names)
    assert int(n) == int(keep.sum()) and torch.allclose(loss, losses[0][torch.from_numpy(keep)].sum())
    assert float(report["image loss"][0]) == 0.0 and float(report["image loss"][1]) == 0.0


def test_loss_counts_targets_for_the_step_check(tokenizer_dir: Path, spec: VocabSpec) -> None:
    """``loss_func`` adds each micro-batch's target counts to the step's accounting (no target: all zero)."""
    opts = options(tokenizer_dir)
    conv = encode_conversations(tokenizer_dir, CONVERSATIONS[:1])[0]
    labels = conv[1:]
    mod = torch.from_numpy(spec.modality_of(labels).astype(np.int64))[None]
    losses = torch.ones(1, labels.size)
    acct = step_targets()
    acct.reset()
    keep = torch.from_numpy(sft_mask(conv, spec).astype(np.float32))[None]
    loss_func(keep, mod, losses, weights=modality_weights(opts, 0), names=spec.modality_names)
    loss_func(torch.zeros_like(keep), mod, losses, weights=modality_weights(opts, 0), names=spec.modality_names)
    assert acct.reduce(1 + len(spec.modality_names))[0] == int(keep.sum()) > 0
    acct.reset()
    loss_func(torch.zeros_like(keep), mod, losses, weights=modality_weights(opts, 0), names=spec.modality_names)
    assert acct.reduce(1 + len(spec.modality_names)) == [0] * (1 + len(spec.modality_names))


def test_scheduled_weight_needs_no_manual_step(tokenizer_dir: Path) -> None:
    opts = options(tokenizer_dir, "--apertus-modality-weight", "image=0:1,100:0")
    names = list(opts.spec.modality_names)
    w0, w50, w200 = (modality_weights(opts, s)[names.index("image")].item() for s in (0, 50, 200))
    assert (w0, w50, w200) == (1.0, 0.5, 0.0)


def test_get_batch_keeps_every_key(tokenizer_dir: Path, spec: VocabSpec, process_group: None) -> None:
    """The adapter's get_batch over a one-rank tensor-parallel group (upstream's drops ``modality``)."""
    s, b = 16, 2
    data = {"tokens": torch.arange(b * s).reshape(b, s), "labels": torch.arange(b * s).reshape(b, s) + 1,
            "loss_mask": torch.ones(b, s), "modality": torch.zeros(b, s, dtype=torch.long),
            "position_ids": torch.arange(s).repeat(b, 1), "attention_mask": torch.zeros(b, 1, s, s, dtype=torch.bool),
            "cu_seqlens": torch.tensor([[0, 5, s]], dtype=torch.int32), "max_seqlen": torch.tensor([11])}
    out = get_batch(iter([data]), micro_batch_size=b, seq_length=s, attention_mask=True, packed_sequences=True)
    for k, v in data.items():
        assert torch.equal(out[k], v), k
    middle = get_batch(iter([data]), micro_batch_size=b, seq_length=s, attention_mask=True, packed_sequences=False,
                       is_first_stage=False, is_last_stage=False)
    assert middle["tokens"] is None and torch.equal(middle["attention_mask"], data["attention_mask"])
    with pytest.raises(KeyError, match="modality"):
        get_batch(iter([{k: v for k, v in data.items() if k != "modality"}]), micro_batch_size=b, seq_length=s,
                  attention_mask=False, packed_sequences=False)


def test_cross_document_settings(tokenizer_dir: Path) -> None:
    from types import SimpleNamespace

    from megatron_patches.training import cross_document_problems

    opts = options(tokenizer_dir)
    local = {"transformer_impl": "local", "masked_softmax_fusion": False, "create_attention_mask_in_dataloader": True,
             "micro_batch_size": 4}
    assert cross_document_problems(SimpleNamespace(**local), opts) == []
    te = cross_document_problems(SimpleNamespace(**{**local, "transformer_impl": "transformer_engine"}), opts)
    assert te and "--apertus-packed-sequences" in te[0]
    fused = cross_document_problems(SimpleNamespace(**{**local, "masked_softmax_fusion": True}), opts)
    assert fused and "--no-masked-softmax-fusion" in fused[0]
    packed = options(tokenizer_dir, "--apertus-packed-sequences")
    assert "--micro-batch-size 1" in cross_document_problems(SimpleNamespace(**local), packed)[0]
    assert cross_document_problems(SimpleNamespace(**{**local, "micro_batch_size": 1}), packed) == []
    # context parallelism splits every sample: only cu_seqlens keep documents apart there
    cp = cross_document_problems(SimpleNamespace(**{**local, "context_parallel_size": 2}), opts)
    assert cp and "--context-parallel-size 2" in cp[0] and "--apertus-packed-sequences" in cp[0]
    assert cross_document_problems(SimpleNamespace(**{**local, "micro_batch_size": 1, "context_parallel_size": 2}),
                                   packed) == []


def test_a_packed_sample_split_over_context_parallel_ranks() -> None:
    """``batch_on_this_cp_rank`` slices every per-token key with the same indices (TE's THD split): the ranks'
    parts put back together are the sample, and labels, masks, modalities and positions stay on their tokens."""
    from megatron_patches.training import CP_SPLIT_KEYS, batch_on_this_cp_rank

    cu = torch.tensor([[0, 8, 12, 24]], dtype=torch.int32)  # documents padded to multiples of 4 (CP = 2)
    s = 24
    tokens = torch.arange(100, 100 + s)[None]
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": (tokens % 3 != 0).float(),
             "modality": tokens % 4, "position_ids": torch.cat([torch.arange(8), torch.arange(4), torch.arange(12)])[None],
             "cu_seqlens": cu, "cu_seqlens_host": cu, "max_seqlen": torch.tensor([12])}
    parts = [batch_on_this_cp_rank(batch, 2, r) for r in (0, 1)]
    # rank 0 holds chunks 0 and 3 of each document, rank 1 chunks 1 and 2 (chunks of 2, 1 and 3 tokens)
    assert parts[0]["tokens"][0].tolist() == [100, 101, 106, 107, 108, 111, 112, 113, 114, 121, 122, 123]
    assert parts[1]["tokens"][0].tolist() == [102, 103, 104, 105, 109, 110, 115, 116, 117, 118, 119, 120]
    for part in parts:
        idx = part["tokens"][0] - 100
        for key in CP_SPLIT_KEYS:
            assert torch.equal(part[key][0], batch[key][0][idx]), key
        assert part["cu_seqlens"] is cu  # the attention reads the whole layout
    assert batch_on_this_cp_rank(batch, 1, 0) is batch
    with pytest.raises(ValueError, match="not a multiple of 2 \\* cp = 4"):
        batch_on_this_cp_rank({**batch, "cu_seqlens_host": torch.tensor([[0, 6, 24]])}, 2, 0)
