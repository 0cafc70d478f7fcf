"""Pretraining and SFT samples over indexed datasets, built by megatron-core's ``BlendedMegatronDatasetBuilder``.

:class:`ApertusDataset` is a megatron-core ``GPTDataset``; each prefix of a blend is one of two kinds:

* pretraining (the default): samples exactly as ``GPTDataset`` cuts them (document, sample and
  shuffle indices, cached as upstream), with the loss targets of the core
  (:func:`apertus_plugins.core.targets.pretraining_targets`: excluded ids, the end-of-document rule,
  Goldfish) and position ids that restart at every end-of-document token;
* SFT (prefixes named by ``--apertus-sft-data``): one tokenized conversation per sequence, packed
  best-fit-decreasing (:func:`apertus_plugins.core.packing.best_fit_decreasing`) into samples of
  ``seq_length + 1`` tokens with cross-document masking, the loss mask derived on the fly from the
  ids (:func:`apertus_plugins.core.targets.sft_mask`) or read from a stored mask stream;
* packed pretraining (prefixes named by ``--apertus-bfd-data``, the long-context stages): whole
  documents packed best-fit-decreasing the same way (a document longer than a sample is split
  into pieces), each with the pretraining targets of the core.

Every sample has the same keys, so blends of both kinds batch together: ``tokens``, ``labels``,
``loss_mask`` (float32, 1 where the label is a target: the step-independent part of the loss
weight), ``modality`` (int64 modality index of each label, ``VocabSpec.modality_names`` order),
``position_ids``; ``attention_mask`` (``[1, S, S]`` bool, True = masked, documents kept apart)
when the config creates attention masks and sequences are not packed; ``cu_seqlens`` and
``max_seqlen`` with ``--apertus-packed-sequences`` (then no ``[S, S]`` mask is built: a sample's
memory is linear in its length, 262,144 tokens included). Upstream's ``get_batch`` drops
``modality``: use :func:`megatron_patches.training.get_batch`.

With a padding multiple ``M > 1`` (``--apertus-pad-to-multiple``, by default ``2 x CP`` under
context parallelism) every packed document occupies a multiple of ``M`` positions: its tokens, then
``<pad>`` inputs whose labels are never targets and whose positions continue the document's, the
padding counted in the document's ``cu_seqlens`` segment (the convention of megatron-core's own
SFT dataset), so that Transformer Engine can cut each document into ``2 x CP`` equal chunks. The
bins are packed on the padded lengths into ``seq_length`` positions, so the samples depend on
``M``, not on the CP size itself.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split

from apertus_plugins.core.packing import PackingConfig, best_fit_decreasing, packed_layout, packed_layout_from_eod
from apertus_plugins.core.targets import TargetConfig, pretraining_targets, sft_targets

from .arguments import ApertusOptions
from .errors import SftPackingError
from .version import require_supported

# the version check follows the imports (import order): an unsupported megatron-core stops here with the
# supported range, before anything of this module is defined or run
require_supported()

__all__ = ["ApertusDatasetConfig", "ApertusDataset", "SftPackingError", "attention_mask_from_documents"]

_LOG = logging.getLogger(__name__)


@dataclass
class ApertusDatasetConfig(GPTDatasetConfig):
    """``GPTDatasetConfig`` plus the Apertus options (``reset_*``/``eod_mask_loss`` are unused: the
    Apertus cross-document rule always applies)."""

    apertus: ApertusOptions | None = None

    def __post_init__(self) -> None:
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                setattr(self, name, False)
        super().__post_init__()
        if self.apertus is None:
            raise ValueError("ApertusDatasetConfig needs apertus=ApertusOptions(...)")
        if not self.add_extra_token_to_sequence:
            raise ValueError("ApertusDatasetConfig needs add_extra_token_to_sequence (labels are ids[1:])")

    def is_sft(self, dataset_path: str | None) -> bool:
        """Whether ``dataset_path`` is one of the ``--apertus-sft-data`` prefixes."""
        return self.apertus.packing.is_sft(dataset_path)

    def is_bfd(self, dataset_path: str | None) -> bool:
        """Whether ``dataset_path`` is one of the ``--apertus-bfd-data`` (packed pretraining) prefixes."""
        return self.apertus.packing.is_bfd(dataset_path)


def attention_mask_from_documents(document_ids: np.ndarray) -> torch.Tensor:
    """``[1, S, S]`` bool, True where attention is masked: the future and other documents (Megatron's convention)."""
    doc = torch.from_numpy(np.ascontiguousarray(document_ids))
    same = doc[:, None] == doc[None, :]
    causal = torch.ones(doc.numel(), doc.numel(), dtype=torch.bool).tril_()
    return (~(same & causal)).unsqueeze(0)


class ApertusDataset(GPTDataset):
    """A megatron-core GPT dataset whose samples carry Apertus loss targets; SFT prefixes are packed conversations.

    Constructed by ``BlendedMegatronDatasetBuilder(ApertusDataset, sizes, is_built_on_rank,
    ApertusDatasetConfig(...))`` like any megatron-core dataset.
    """

    def __init__(
        self,
        indexed_dataset: MegatronIndexedDataset,
        dataset_path: str | None,
        indexed_indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: ApertusDatasetConfig,
    ) -> None:
        self.is_sft = config.is_sft(dataset_path)
        self.is_bfd = config.is_bfd(dataset_path)
        self.is_packed = self.is_sft or self.is_bfd
        opts = config.apertus
        self.spec = opts.spec
        self.packing: PackingConfig = opts.packing
        # the step-independent part of the targets; the modality weights are applied in the loss
        self.keep_config: TargetConfig = replace(opts.targets, modality_weights={})
        self.pad_multiple = self.packing.pad_multiple
        if self.pad_multiple > 1 and config.sequence_length % self.pad_multiple:
            raise SftPackingError(f"{dataset_path}: --seq-length {config.sequence_length} is not a multiple of the "
                                  f"padding multiple {self.pad_multiple} of packed documents")
        if not self.is_packed:
            if self.pad_multiple > 1:
                raise SftPackingError(
                    f"{dataset_path}: packed documents are padded to multiples of {self.pad_multiple} (context "
                    "parallelism), which only packed prefixes allow: name it in --apertus-bfd-data (pretraining "
                    "documents) or --apertus-sft-data (conversations)")
            super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
            return
        MegatronDataset.__init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                                 config)
        self._stored_mask = None
        if self.is_sft and opts.sft_mask == "stored":
            self._stored_mask = _open_mask_stream(dataset_path, opts.sft_mask_suffix, indexed_dataset, config)
        self._build_sft_index()

    # ------------------------------------------------------------------ SFT packing
    def _build_sft_index(self) -> None:
        # without padding a bin holds S + 1 tokens (the last one only a label); with padding multiple M > 1
        # a piece of n tokens takes pad(n) of the S input positions
        padded = self.packing.padded
        capacity = self.packing.capacity(self.config.sequence_length)
        lengths = self.dataset.sequence_lengths[self.indices].astype(np.int64)
        what = "conversation" if self.is_sft else "document"
        if lengths.size == 0:
            raise SftPackingError(f"{self.dataset_path}: no {what}s in the {self.index_split.name} split")
        if lengths.min() < 2:
            raise SftPackingError(f"{self.dataset_path}: a {what} has fewer than 2 tokens "
                                  f"(sequence {int(self.indices[int(lengths.argmin())])})")
        oversize = self.packing.oversize(self.dataset_path)
        if oversize == "error" and lengths.max() > capacity:
            k = int(np.argmax(lengths > capacity))
            holds = f"--seq-length {self.config.sequence_length}" + ("" if padded else " + 1")
            raise SftPackingError(
                f"{self.dataset_path}: conversation {int(self.indices[k])} has {int(lengths[k])} tokens, more than "
                f"a sample holds ({holds}); pass --apertus-sft-oversize split to cut long conversations into pieces")
        bins = best_fit_decreasing(self.packing.slots(lengths), capacity, oversize=oversize)
        order = np.argsort(bins.piece_bin, kind="stable")
        self._piece_doc = bins.piece_doc[order]
        self._piece_start = bins.piece_start[order]
        self._piece_slots = bins.piece_length[order]
        # a piece's tokens: the padded document's piece less the padding (pieces are cut at multiples of M)
        self._piece_len = np.minimum(self._piece_slots, lengths[self._piece_doc] - self._piece_start)
        self._bin_bounds = np.searchsorted(bins.piece_bin[order], np.arange(bins.num_bins + 1))
        self.num_bins = bins.num_bins
        wanted = self.num_samples if self.num_samples is not None else self.num_bins
        epochs = max(1, -(-wanted // self.num_bins))
        rng = np.random.RandomState(self.config.random_seed)
        self._sample_bins = np.concatenate([rng.permutation(self.num_bins) for _ in range(epochs)])
        fill = float(lengths.sum()) / (self.num_bins * capacity)
        _LOG.info("%s: %d %ss packed best-fit-decreasing into %d samples of %d tokens (%.1f%% filled, %s split)",
                  self.dataset_path, lengths.size, what, self.num_bins, capacity, 100 * fill, self.index_split.name)

    def _conversation_targets(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, per-label keep mask) of one whole conversation (SFT) or document (packed pretraining)."""
        ids = np.asarray(self.dataset.get(int(seq)), dtype=np.int64)
        if self.is_bfd:
            weights = pretraining_targets(ids, self.spec, self.keep_config, goldfish=self.config.apertus.goldfish).weights
            return ids, weights > 0
        stored = self._stored_mask.get(int(seq)) if self._stored_mask is not None else None
        opts = self.config.apertus
        return ids, sft_targets(ids, self.spec, stored=stored, goldfish=opts.goldfish, specials=opts.sft_specials)

    def _sft_sample(self, sample: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ids of S+1 tokens, keep mask of the S labels, document ids and positions of the S inputs)."""
        b = int(self._sample_bins[sample])
        lo, hi = int(self._bin_bounds[b]), int(self._bin_bounds[b + 1])
        seq_len = self.config.sequence_length
        padded = self.packing.padded
        span = seq_len if padded else seq_len + 1  # the positions the segments cover
        ids = np.full(seq_len + 1, self.spec.pad_id, dtype=np.int64)
        keep = np.zeros(seq_len, dtype=bool)
        segments = []
        pos = 0
        for p in range(lo, hi):
            seq = self.indices[int(self._piece_doc[p])]
            start, n = int(self._piece_start[p]), int(self._piece_len[p])
            conv, conv_keep = self._conversation_targets(seq)
            ids[pos:pos + n] = conv[start:start + n]
            # labels inside the piece; the piece's last token predicts the next document (or its padding):
            # not a target
            keep[pos:pos + n - 1] = conv_keep[start:start + n - 1]
            width = int(self._piece_slots[p]) if padded else n
            segments.append(width)
            pos += width
        if pos < span:
            segments.append(span - pos)  # the bin's free room: padding, its own segment, never a target
        layout = packed_layout(segments)
        if padded:  # the segments cover exactly the S inputs
            return ids, keep, layout.document_ids, layout.position_ids
        return ids, keep, layout.document_ids[:-1], layout.position_ids[:-1]  # over S+1 tokens: the first S

    # ------------------------------------------------------------------ samples
    def __len__(self) -> int:
        if self.is_packed:
            return int(self._sample_bins.size)
        return super().__len__()

    def _pretraining_sample(self, idx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ids of S+1 tokens, keep mask of the S labels, document ids and positions of the S inputs)."""
        text = self._query_document_sample_shuffle_indices(idx)[0]  # (text, document ids[, ...] in 0.19)
        ids = np.asarray(text, dtype=np.int64)
        weights = pretraining_targets(ids, self.spec, self.keep_config, goldfish=self.config.apertus.goldfish).weights
        layout = packed_layout_from_eod(ids[:-1], self.spec.eos_id)
        return ids, weights > 0, layout.document_ids, layout.position_ids

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """One sample (see the module docstring); ``idx=None`` is a padding sample with no targets."""
        i = 0 if idx is None else int(idx)
        ids, keep, doc_ids, positions = self._sft_sample(i) if self.is_packed else self._pretraining_sample(i)
        seq_len = ids.size - 1
        if idx is None:
            keep = np.zeros_like(keep)
        labels = ids[1:]
        sample = {
            "tokens": torch.from_numpy(ids[:-1].copy()),
            "labels": torch.from_numpy(labels.copy()),
            "loss_mask": torch.from_numpy(keep.astype(np.float32)),
            "modality": torch.from_numpy(self.spec.modality_of(labels).astype(np.int64)),
            "position_ids": torch.from_numpy(positions.astype(np.int64)),
        }
        if self.config.create_attention_mask and not self.packing.packed_sequences:
            sample["attention_mask"] = attention_mask_from_documents(doc_ids)  # [S, S]: only without cu_seqlens
        if self.packing.packed_sequences:
            bounds = np.flatnonzero(np.diff(doc_ids)) + 1
            cu = np.concatenate([[0], bounds, [seq_len]]).astype(np.int32)
            sample["cu_seqlens"] = torch.from_numpy(cu)
            sample["max_seqlen"] = torch.tensor(int(np.diff(cu).max()), dtype=torch.int32)
        return sample


def _open_mask_stream(prefix: str, suffix: str, tokens: MegatronIndexedDataset,
                      config: ApertusDatasetConfig) -> MegatronIndexedDataset:
    mask_prefix = prefix + suffix
    if not (os.path.isfile(mask_prefix + ".bin") and os.path.isfile(mask_prefix + ".idx")):
        raise SftPackingError(f"{prefix}: --apertus-sft-mask stored, but the mask stream {mask_prefix}.bin/.idx "
                              "does not exist")
    masks = MegatronIndexedDataset(mask_prefix, multimodal=False, mmap=config.mmap_bin_files)
    if not np.array_equal(masks.sequence_lengths, tokens.sequence_lengths):
        raise SftPackingError(f"{mask_prefix}: the mask stream's sequence lengths differ from {prefix}'s tokens")
    return masks


def build_datasets(config: ApertusDatasetConfig, sizes: list[int | None],
                   is_built_on_rank: Any = lambda: True) -> tuple[Any, Any, Any]:
    """``BlendedMegatronDatasetBuilder(ApertusDataset, sizes, is_built_on_rank, config).build()``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    return BlendedMegatronDatasetBuilder(ApertusDataset, sizes, is_built_on_rank, config).build()
