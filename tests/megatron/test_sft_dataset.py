"""The Apertus dataset built by megatron-core's own BlendedMegatronDatasetBuilder, against the core.

A blend of a pretraining prefix and an SFT prefix (tokenized conversations, one per sequence, as the
offline pipeline writes them): every SFT sample is conversations packed best-fit-decreasing whose
loss mask equals the core's ``sft_mask`` of each conversation (the cross-document label excluded);
every pretraining sample carries the core's ``pretraining_targets``; positions restart per
document; the attention mask keeps documents apart. Then the errors that must come before
training: corrupt or mismatched ``.bin``/``.idx`` pairs, a prefix missing from the manifest, a
vocabulary that does not fit the embedding.
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CONVERSATIONS, encode_conversations, null_tokenizer, write_pretraining_prefix, write_sft_prefix

from apertus_plugins.core.packing import packed_layout_from_eod
from apertus_plugins.core.targets import pretraining_targets, sft_mask
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.data.indexed import IndexedDatasetWriter, optimal_dtype
from apertus_plugins.data.manifest import write_manifest
from megatron_patches.arguments import add_apertus_args, options_from_args
from megatron_patches.dataset import ApertusDataset, ApertusDatasetConfig, build_datasets
from megatron_patches.errors import ApertusArgumentError, PreflightError, SftPackingError
from megatron_patches.training import data_prefixes, preflight

SEQ = 256


def options(tokenizer_dir: Path, *extra: str) -> Any:
    parser = add_apertus_args(argparse.ArgumentParser())
    return options_from_args(parser.parse_args(["--apertus-tokenizer", str(tokenizer_dir), *extra]))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, spec: VocabSpec) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("data")
    pre, sft = str(root / "pretrain"), str(root / "sft")
    docs = write_pretraining_prefix(Path(pre), spec, n_docs=80)
    convs = write_sft_prefix(Path(sft), tokenizer_dir, CONVERSATIONS, repeat=6, mask=True)
    manifest = root / "stage.json"
    write_manifest([pre, sft], manifest)
    return {"root": root, "pre": pre, "sft": sft, "docs": docs, "convs": convs, "manifest": manifest}


def make_config(data: dict[str, Any], opts: Any, spec: VocabSpec, **kw: Any) -> ApertusDatasetConfig:
    values = {"random_seed": 1234, "sequence_length": SEQ, "blend": ([data["pre"], data["sft"]], [0.5, 0.5]),
              "split": "100,0,0", "tokenizer": null_tokenizer(spec.size), "create_attention_mask": True,
              "path_to_cache": str(data["root"] / "cache"), "mid_level_dataset_surplus": 0.5}
    values.update(kw)
    return ApertusDatasetConfig(**values, apertus=opts)


def conversation_spans(position_ids: np.ndarray) -> list[tuple[int, int]]:
    starts = np.flatnonzero(position_ids == 0).tolist() + [position_ids.size]
    return list(zip(starts[:-1], starts[1:], strict=True))


def segment(ids: np.ndarray, a: int, b: int, spec: VocabSpec) -> np.ndarray:
    """The tokens of the document whose inputs are ``a:b`` (the sample's last one also owns the final label)."""
    seg = ids[a:b + 1] if b == ids.size - 1 else ids[a:b]
    if seg.size and not np.all(seg == spec.pad_id):
        seg = seg[: seg.size - int(np.argmax(seg[::-1] != spec.pad_id))]  # no conversation ends with <pad>
    return seg


def check_sft_sample(sample: dict[str, torch.Tensor], convs: list[np.ndarray], spec: VocabSpec) -> int:
    """Every packed conversation is one of the written ones with the core's mask; returns how many."""
    tokens = sample["tokens"].numpy()
    keep = sample["loss_mask"].numpy()
    ids = np.concatenate([tokens, sample["labels"].numpy()[-1:]])
    known = {tuple(c.tolist()): c for c in convs}
    found = 0
    for a, b in conversation_spans(sample["position_ids"].numpy()):
        seg = segment(ids, a, b, spec)
        if seg.size == 0 or np.all(seg == spec.pad_id):
            assert not keep[a:b].any()  # padding is never a target
            continue
        conv = known.get(tuple(seg.tolist()))
        assert conv is not None, "a packed segment is not one of the written conversations"
        want = sft_mask(conv, spec)
        n = conv.size
        assert keep[a:a + n - 1].tolist() == want.astype(np.float32).tolist()
        if a + n - 1 < keep.size:
            assert keep[a + n - 1] == 0  # the cross-document label
        found += 1
    return found


def test_blend_built_by_megatron_builder(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                         process_group: None) -> None:
    opts = options(tokenizer_dir, "--apertus-sft-data", data["sft"], "--apertus-targets", "text-only",
                   "--apertus-goldfish-k", "4", "--apertus-goldfish-h", "3")
    train, valid, test = build_datasets(make_config(data, opts, spec), [40, 0, 0])
    assert valid is None and test is None and len(train) >= 40
    assert all(isinstance(d, ApertusDataset) for d in train.datasets)
    assert sorted(d.is_sft for d in train.datasets) == [False, True]
    seen = {"sft": 0, "pre": 0}
    for i in range(40):
        s = train[i]
        ds = train.datasets[int(s["dataset_id"])]
        assert set(s) >= {"tokens", "labels", "loss_mask", "modality", "position_ids", "attention_mask"}
        assert s["tokens"].shape == s["labels"].shape == s["loss_mask"].shape == (SEQ,)
        assert s["attention_mask"].shape == (1, SEQ, SEQ) and s["attention_mask"].dtype == torch.bool
        labels = s["labels"].numpy()
        assert s["modality"].numpy().tolist() == spec.modality_of(labels).tolist()
        pos = s["position_ids"].numpy()
        if ds.is_sft:
            seen["sft"] += 1
            assert check_sft_sample(s, data["convs"], spec) >= 1
        else:
            seen["pre"] += 1
            ids = np.concatenate([s["tokens"].numpy(), labels[-1:]])
            keep_cfg = replace(opts.targets, modality_weights={})
            want = pretraining_targets(ids, spec, keep_cfg, goldfish=opts.goldfish).weights > 0
            assert s["loss_mask"].numpy().astype(bool).tolist() == want.tolist()
            layout = packed_layout_from_eod(ids[:-1], spec.eos_id)
            assert pos.tolist() == layout.position_ids.tolist()
        # documents never attend to each other; within one, attention is causal
        mask = s["attention_mask"][0].numpy()
        doc = np.cumsum(pos == 0)
        allowed = (doc[:, None] == doc[None, :]) & np.tri(SEQ, dtype=bool)
        assert (~mask).tolist() == allowed.tolist()
    assert seen["sft"] > 5 and seen["pre"] > 5


def test_sft_epoch_covers_every_conversation(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                             process_group: None) -> None:
    opts = options(tokenizer_dir, "--apertus-sft-data", data["sft"])
    config = make_config(data, opts, spec, blend=([data["sft"]], None))
    train, _, _ = build_datasets(config, [None, None, None])
    assert isinstance(train, ApertusDataset) and train.is_sft
    # one epoch: every conversation packed exactly once, bins within capacity
    total = sum(check_sft_sample(train[i], data["convs"], spec) for i in range(train.num_bins))
    assert total == len(data["convs"])
    lengths = [c.size for c in data["convs"]]
    assert train.num_bins >= -(-sum(lengths) // (SEQ + 1))


def test_pretraining_prefix_packed_best_fit_decreasing(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                                       process_group: None) -> None:
    """``--apertus-bfd-data``: one epoch holds every document once, whole, with its pretraining targets."""
    opts = options(tokenizer_dir, "--apertus-bfd-data", data["pre"], "--apertus-goldfish-k", "4",
                   "--apertus-goldfish-h", "3")
    train, _, _ = build_datasets(make_config(data, opts, spec, blend=([data["pre"]], None)), [None, None, None])
    assert isinstance(train, ApertusDataset) and train.is_bfd and not train.is_sft
    keep_cfg = replace(opts.targets, modality_weights={})
    known = {tuple(d.tolist()): d for d in data["docs"]}
    found = []
    for i in range(train.num_bins):
        s = train[i]
        tokens, keep, pos = s["tokens"].numpy(), s["loss_mask"].numpy(), s["position_ids"].numpy()
        ids = np.concatenate([tokens, s["labels"].numpy()[-1:]])
        for a, b in conversation_spans(pos):
            seg = segment(ids, a, b, spec)
            if seg.size == 0 or np.all(seg == spec.pad_id):
                assert not keep[a:b].any()
                continue
            doc = known.get(tuple(seg.tolist()))
            assert doc is not None, "a packed segment is not one of the written documents"
            want = pretraining_targets(doc, spec, keep_cfg, goldfish=opts.goldfish).weights > 0
            n = doc.size
            assert keep[a:a + n - 1].astype(bool).tolist() == want.tolist()
            if a + n - 1 < keep.size:
                assert keep[a + n - 1] == 0  # the label after the document's last token (the next document)
            found.append(n)
        mask = s["attention_mask"][0].numpy()
        docs = np.cumsum(pos == 0)
        assert (~mask).tolist() == ((docs[:, None] == docs[None, :]) & np.tri(SEQ, dtype=bool)).tolist()
    assert sorted(found) == sorted(d.size for d in data["docs"])  # every document once per epoch
    # best-fit-decreasing fills the bins: no more of them than first-fit would need by much
    assert train.num_bins <= -(-sum(found) // (SEQ + 1)) + 1


def test_stored_mask_equals_derived(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                    process_group: None) -> None:
    derived = build_datasets(make_config(data, options(tokenizer_dir, "--apertus-sft-data", data["sft"]), spec,
                                         blend=([data["sft"]], None)), [None, None, None])[0]
    stored = build_datasets(make_config(data, options(tokenizer_dir, "--apertus-sft-data", data["sft"],
                                                      "--apertus-sft-mask", "stored"), spec,
                                        blend=([data["sft"]], None)), [None, None, None])[0]
    assert len(derived) == len(stored)
    for i in range(len(derived)):
        a, b = derived[i], stored[i]
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["loss_mask"], b["loss_mask"])


def test_oversize_conversations(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                process_group: None) -> None:
    longest = max(c.size for c in data["convs"])
    seq = longest // 2
    opts = options(tokenizer_dir, "--apertus-sft-data", data["sft"])
    with pytest.raises(SftPackingError, match="apertus-sft-oversize split"):
        build_datasets(make_config(data, opts, spec, blend=([data["sft"]], None), sequence_length=seq),
                       [None, None, None])
    opts = options(tokenizer_dir, "--apertus-sft-data", data["sft"], "--apertus-sft-oversize", "split")
    ds = build_datasets(make_config(data, opts, spec, blend=([data["sft"]], None), sequence_length=seq),
                        [None, None, None])[0]
    # every piece's labels carry the whole conversation's mask, sliced
    masks = {tuple(c.tolist()): sft_mask(c, spec) for c in data["convs"]}
    trained = 0
    for i in range(ds.num_bins):
        s = ds[i]
        ids = np.concatenate([s["tokens"].numpy(), s["labels"].numpy()[-1:]])
        keep = s["loss_mask"].numpy()
        for a, b in conversation_spans(s["position_ids"].numpy()):
            seg = segment(ids, a, b, spec)
            if seg.size == 0 or np.all(seg == spec.pad_id):
                continue
            hits = [(conv, m) for conv, m in masks.items() if _find(np.asarray(conv), seg) is not None]
            assert hits, "a piece is not a slice of any conversation"
            conv, m = np.asarray(hits[0][0]), hits[0][1]
            start = _find(conv, seg)
            n = seg.size
            assert keep[a:a + n - 1].tolist() == m[start:start + n - 1].astype(np.float32).tolist()
            trained += int(keep[a:a + n - 1].sum())
    assert trained > 0


def _find(hay: np.ndarray, needle: np.ndarray) -> int | None:
    for s in range(hay.size - needle.size + 1):
        if np.array_equal(hay[s:s + needle.size], needle):
            return s
    return None


def test_packed_sequences_cu_seqlens(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                     process_group: None) -> None:
    opts = options(tokenizer_dir, "--apertus-sft-data", data["sft"], "--apertus-packed-sequences")
    ds = build_datasets(make_config(data, opts, spec, blend=([data["sft"]], None), create_attention_mask=False),
                        [None, None, None])[0]
    s = ds[0]
    assert "attention_mask" not in s
    cu = s["cu_seqlens"].numpy()
    pos = s["position_ids"].numpy()
    assert cu[0] == 0 and cu[-1] == SEQ and np.all(np.diff(cu) > 0)
    assert cu[:-1].tolist() == np.flatnonzero(pos == 0).tolist()
    assert int(s["max_seqlen"]) == int(np.diff(cu).max())


def test_sft_goldfish_optional(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                               process_group: None) -> None:
    from apertus_plugins.core.goldfish import goldfish_drop

    flags = ("--apertus-sft-data", data["sft"], "--apertus-goldfish-k", "2", "--apertus-goldfish-h", "2")
    plain = build_datasets(make_config(data, options(tokenizer_dir, *flags), spec, blend=([data["sft"]], None)),
                           [None, None, None])[0]
    gold = build_datasets(make_config(data, options(tokenizer_dir, *flags, "--apertus-goldfish-sft"), spec,
                                      blend=([data["sft"]], None)), [None, None, None])[0]
    conv = data["convs"][1]
    want = sft_mask(conv, spec) & ~goldfish_drop(conv[1:], k=2, h=2, spec=spec)
    assert plain[0]["loss_mask"].sum() >= gold[0]["loss_mask"].sum()
    assert gold._conversation_targets(1)[1].tolist() == want.tolist()


# ------------------------------------------------------------------------------ preflight errors
def run_preflight(opts: Any, prefixes: list[str], rows: int = 2048) -> None:
    preflight(opts, data_prefixes((prefixes, None), None), embedding_rows=rows)


def test_preflight_passes_on_good_data(data: dict[str, Any], tokenizer_dir: Path) -> None:
    opts = options(tokenizer_dir, "--apertus-sft-data", data["sft"], "--apertus-manifest", str(data["manifest"]))
    run_preflight(opts, [data["pre"], data["sft"]])


def test_corrupt_bin_fails_before_training(data: dict[str, Any], tmp_path: Path, tokenizer_dir: Path) -> None:
    bad = str(tmp_path / "pretrain")
    for ext in (".bin", ".idx"):
        shutil.copy(data["pre"] + ext, bad + ext)
    with open(bad + ".bin", "r+b") as fh:
        fh.truncate(os.path.getsize(bad + ".bin") - 6)
    with pytest.raises(PreflightError, match=r"pretrain\.bin: .* bytes, but pretrain\.idx describes"):
        run_preflight(options(tokenizer_dir), [bad])


def test_mismatched_pair_fails_before_training(data: dict[str, Any], tmp_path: Path, tokenizer_dir: Path) -> None:
    bad = str(tmp_path / "mixed")
    shutil.copy(data["pre"] + ".bin", bad + ".bin")
    shutil.copy(data["sft"] + ".idx", bad + ".idx")
    with pytest.raises(PreflightError, match="mixed"):
        run_preflight(options(tokenizer_dir), [bad])
    os.unlink(bad + ".idx")
    with pytest.raises(PreflightError, match=r"mixed\.idx"):
        run_preflight(options(tokenizer_dir), [bad])


def test_prefix_missing_from_manifest(data: dict[str, Any], tmp_path: Path, tokenizer_dir: Path) -> None:
    extra = str(tmp_path / "extra")
    write_sft_prefix(Path(extra), tokenizer_dir, CONVERSATIONS[:1])
    opts = options(tokenizer_dir, "--apertus-manifest", str(data["manifest"]))
    with pytest.raises(PreflightError, match=r"extra: not in the manifest"):
        run_preflight(opts, [data["pre"], data["sft"], extra])
    with pytest.raises(PreflightError, match=r"sft: in the manifest but missing from the dataset list"):
        run_preflight(opts, [data["pre"]])


def test_changed_dataset_fails_manifest(data: dict[str, Any], tmp_path: Path, tokenizer_dir: Path,
                                        spec: VocabSpec) -> None:
    pre = str(tmp_path / "p")
    write_pretraining_prefix(Path(pre), spec, n_docs=5, seed=1)
    manifest = tmp_path / "m.json"
    write_manifest([pre], manifest)
    blob = bytearray(Path(pre + ".bin").read_bytes())
    blob[len(blob) // 2] ^= 1  # one token changed: same sizes and counts
    Path(pre + ".bin").write_bytes(bytes(blob))
    # the launch-time default checks sizes and counts (TB blends); the sha256 is opt-in there
    run_preflight(options(tokenizer_dir, "--apertus-manifest", str(manifest)), [pre])
    with pytest.raises(PreflightError, match=r"bin_sha256"):
        run_preflight(options(tokenizer_dir, "--apertus-manifest", str(manifest), "--apertus-manifest-checksums"), [pre])
    write_pretraining_prefix(Path(pre), spec, n_docs=4, seed=1)  # fewer documents: caught by the default check
    with pytest.raises(PreflightError, match=r"documents is 4, the manifest says 5"):
        run_preflight(options(tokenizer_dir, "--apertus-manifest", str(manifest)), [pre])


def test_vocabulary_must_fit_embedding(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec) -> None:
    with pytest.raises(PreflightError, match=rf"embedding has 1000 rows but the vocabulary needs {spec.size}"):
        run_preflight(options(tokenizer_dir), [data["pre"]], rows=1000)
    with pytest.raises(ValueError, match=r"--apertus-embedding-rows"):
        options(tokenizer_dir, "--apertus-embedding-rows", "1000")


def test_sft_prefix_must_be_in_blend(data: dict[str, Any], tokenizer_dir: Path) -> None:
    with pytest.raises(PreflightError, match=r"--apertus-sft-data .*typo: not one of the run's data prefixes"):
        run_preflight(options(tokenizer_dir, "--apertus-sft-data", data["sft"] + "typo"), [data["pre"]])


def test_stored_mask_must_exist(data: dict[str, Any], tmp_path: Path, tokenizer_dir: Path) -> None:
    sft = str(tmp_path / "nomask")
    write_sft_prefix(Path(sft), tokenizer_dir, CONVERSATIONS)
    opts = options(tokenizer_dir, "--apertus-sft-data", sft, "--apertus-sft-mask", "stored")
    with pytest.raises(PreflightError, match=r"nomask\.mask"):
        run_preflight(opts, [sft])


def test_conversations_tokenized_as_written(data: dict[str, Any], tokenizer_dir: Path) -> None:
    from apertus_plugins.data.indexed import IndexedDataset

    ds = IndexedDataset(data["sft"])
    want = encode_conversations(tokenizer_dir, CONVERSATIONS) * 6
    assert len(ds) == len(want)
    assert all(ds[i].tolist() == w.tolist() for i, w in enumerate(want))


# ------------------------------------------------------------------------------ context parallelism, long samples
def test_documents_padded_for_context_parallelism(data: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                                  process_group: None) -> None:
    """With a padding multiple (2 x CP) every packed document fills a multiple of it; the targets are unchanged."""
    flags = ("--apertus-sft-data", data["sft"], "--apertus-packed-sequences", "--apertus-pad-to-multiple", "8")
    ds = build_datasets(make_config(data, options(tokenizer_dir, *flags), spec, blend=([data["sft"]], None),
                                    create_attention_mask=True), [None, None, None])[0]
    known = {tuple(c.tolist()): sft_mask(c, spec) for c in data["convs"]}
    docs = 0
    for i in range(ds.num_bins):
        s = ds[i]
        assert "attention_mask" not in s  # cu_seqlens replace the [S, S] mask
        cu, pos = s["cu_seqlens"].numpy(), s["position_ids"].numpy()
        tokens, labels, keep = s["tokens"].numpy(), s["labels"].numpy(), s["loss_mask"].numpy()
        assert cu[0] == 0 and cu[-1] == SEQ and np.all(np.diff(cu) % 8 == 0)
        assert cu[:-1].tolist() == np.flatnonzero(pos == 0).tolist() and int(s["max_seqlen"]) == np.diff(cu).max()
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            seg = tokens[a:b]
            real = seg[seg != spec.pad_id]
            if real.size == 0:
                assert not keep[a:b].any()
                continue
            n = real.size
            assert np.all(seg[n:] == spec.pad_id) and b - a - n < 8  # padding after the document, less than 8
            want = known[tuple(real.tolist())]
            assert keep[a:a + n - 1].tolist() == want.astype(np.float32).tolist()
            assert not keep[a + n - 1:b].any() and np.array_equal(labels[a:a + n - 1], real[1:])
            docs += 1
    assert docs >= len(data["convs"]) // 2
    # a pretraining prefix cut as Megatron cuts it cannot be split per document: refused, naming the way out
    with pytest.raises(SftPackingError, match="name it in --apertus-bfd-data"):
        build_datasets(make_config(data, options(tokenizer_dir, *flags), spec, blend=([data["pre"]], None)),
                       [None, None, None])
    problems = pytest.raises(PreflightError, match="every prefix must be packed")
    with problems:
        preflight(options(tokenizer_dir, *flags), [data["pre"], data["sft"]], embedding_rows=2048)


def test_cp_options(tokenizer_dir: Path) -> None:
    def opts(*flags: str) -> Any:
        parser = add_apertus_args(argparse.ArgumentParser())
        parser.add_argument("--context-parallel-size", type=int, default=1)
        return options_from_args(parser.parse_args(["--apertus-tokenizer", str(tokenizer_dir), *flags]))

    assert opts("--apertus-packed-sequences", "--context-parallel-size", "4").pad_multiple == 8
    assert opts("--apertus-packed-sequences").pad_multiple == 1
    assert opts("--apertus-packed-sequences", "--apertus-pad-to-multiple", "4").pad_multiple == 4
    with pytest.raises(ApertusArgumentError, match="must be a multiple of 8"):
        opts("--apertus-packed-sequences", "--context-parallel-size", "4", "--apertus-pad-to-multiple", "12")
    with pytest.raises(ApertusArgumentError, match="pass --apertus-packed-sequences"):
        opts("--apertus-pad-to-multiple", "4")


@pytest.mark.parametrize("multiple", [1, 32])
def test_a_262144_token_sample_takes_linear_memory(tmp_path: Path, tokenizer_dir: Path, spec: VocabSpec,
                                                   multiple: int, process_group: None) -> None:
    """One long-context SFT sample (262,144 tokens, several conversations, Goldfish on): no [S, S] object.

    The peak of the allocations made while building the sample (numpy, traced) stays under 64 MiB
    beyond its tokens, where an [S, S] mask alone would take 64 GiB; every returned tensor is
    linear in S.
    """
    import tracemalloc

    from apertus_plugins.core.release import CONTEXT_LENGTH

    seq = CONTEXT_LENGTH
    turns = [{"role": "user", "content": "Summarise the report. " * 40},
             {"role": "assistant", "content": "The report describes long-context training. " * 120}]
    base = encode_conversations(tokenizer_dir, [turns * 6])[0]
    prefix = tmp_path / "long"
    with IndexedDatasetWriter(prefix, optimal_dtype(spec.size)) as w:
        for k in range(int(1.2 * seq / base.size) + 2):
            w.add_document(base[: base.size - 7 * (k % 5)] if k % 5 else base)
    flags = ["--apertus-sft-data", str(prefix), "--apertus-packed-sequences", "--apertus-goldfish-k", "50",
             "--apertus-goldfish-sft"]
    if multiple > 1:
        flags += ["--apertus-pad-to-multiple", str(multiple)]
    config = ApertusDatasetConfig(random_seed=1, sequence_length=seq, blend=([str(prefix)], None), split="100,0,0",
                                  tokenizer=null_tokenizer(spec.size), create_attention_mask=True,
                                  path_to_cache=str(tmp_path / "cache"), apertus=options(tokenizer_dir, *flags))
    ds = build_datasets(config, [None, None, None])[0]
    ds[0]  # warm caches (tables, the index)
    tracemalloc.start()
    sample = ds[1]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tokens_bytes = (seq + 1) * 8
    assert peak - tokens_bytes < 64 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert all(v.numel() <= seq + 1 for v in sample.values()), {k: v.shape for k, v in sample.items()}
    assert "attention_mask" not in sample and sample["tokens"].numel() == seq
    assert int(np.diff(sample["cu_seqlens"].numpy()).size) >= 2  # several conversations in the sample
    assert 0 < float(sample["loss_mask"].sum()) < seq
    print(f"262,144-token SFT sample (multiple {multiple}): peak {peak / 2**20:.1f} MiB of numpy allocations")
