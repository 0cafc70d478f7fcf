"""The synthetic long-context tasks read back by megatron-core's own dataset builder (report section 3.3).

``apertus tokenize longcontext`` writes an SFT prefix; a long-context recipe's ``--apertus-*`` flags
plus ``--apertus-sft-data`` take it directly, next to a best-fit-decreasing pretraining prefix as the
extension steps blend them. Every example is packed whole, and its loss mask in the samples is the
one written (answers only), derived from the ids or read from the stored mask stream.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import null_tokenizer, write_pretraining_prefix

from apertus_plugins.core.chat import ChatTokenizer
from apertus_plugins.core.longcontext import report_mix
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.data.indexed import IndexedDataset
from apertus_plugins.data.longcontext import write_long_context
from megatron_patches.arguments import add_apertus_args, options_from_args
from megatron_patches.dataset import ApertusDatasetConfig, build_datasets
from megatron_patches.recipes import RECIPES, split_flags

SEQ = 2048


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, spec: VocabSpec) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("longcontext")
    chat = ChatTokenizer(tokenizer_dir)
    rng = np.random.default_rng(0)
    vocab = ["river", "mountain", "forest", "valley", "meadow", "glacier", "harbor", "island", "canyon", "desert",
             "prairie", "lagoon", "tundra", "summit", "plateau", "delta", "marsh", "ridge", "cliff", "grove"]
    per_word = len(chat.text_ids(" ".join(rng.choice(vocab, 300)))) / 300
    src = root / "docs.jsonl"
    with open(src, "w", encoding="utf-8") as fh:
        for k in range(16):
            share = rng.uniform(0.3, 0.45) if k % 2 else rng.uniform(0.55, 0.8)
            fh.write(json.dumps({"text": " ".join(rng.choice(vocab, int(share * SEQ / per_word)))}) + "\n")
    prefix = str(root / "synth")
    report = write_long_context([src], prefix, chat, length=SEQ, mix=report_mix("8b", "32k"), seed=2)
    pre = str(root / "pre")
    write_pretraining_prefix(Path(pre), spec, n_docs=30)
    ds = IndexedDataset(prefix)
    examples = [np.asarray(ds[k], np.int64) for k in range(len(ds))]
    masks = IndexedDataset(prefix + ".mask")
    return {"root": root, "prefix": prefix, "pre": pre, "report": report, "examples": examples,
            "masks": [np.asarray(masks[k]).astype(bool) for k in range(len(masks))]}


def recipe_options(tokenizer_dir: Path, *extra: str) -> Any:
    """The ``--apertus-*`` flags of the 8B 32k extension recipe, with ``extra`` on top."""
    flags = [f for group in split_flags(RECIPES["long-context-8b-32k"].flags) if group[0].startswith("--apertus-")
             for f in group]
    parser = add_apertus_args(argparse.ArgumentParser())
    args, _unknown = parser.parse_known_args(["--apertus-tokenizer", str(tokenizer_dir), *flags, *extra])
    return options_from_args(args)


def config(synth: dict[str, Any], opts: Any, spec: VocabSpec, blend: list[str]) -> ApertusDatasetConfig:
    return ApertusDatasetConfig(random_seed=5, sequence_length=SEQ, blend=(blend, None), split="100,0,0",
                                tokenizer=null_tokenizer(spec.size), create_attention_mask=False,
                                path_to_cache=str(synth["root"] / "cache"), mid_level_dataset_surplus=0.5, apertus=opts)


def test_recipe_takes_the_synthetic_prefix(synth: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                           process_group: None) -> None:
    prefix = synth["prefix"]
    assert synth["report"]["longest"] <= SEQ and sum(synth["report"]["examples"].values()) == len(synth["examples"])
    opts = recipe_options(tokenizer_dir, "--apertus-sft-data", prefix)
    assert opts.packed_sequences and opts.sft_prefixes == (prefix,)
    train = build_datasets(config(synth, opts, spec, [prefix]), [None, None, None])[0]
    known = {tuple(e.tolist()): (e, m) for e, m in zip(synth["examples"], synth["masks"], strict=True)}
    seen = []
    for i in range(train.num_bins):
        s = train[i]
        ids = np.concatenate([s["tokens"].numpy(), s["labels"].numpy()[-1:]])
        keep = s["loss_mask"].numpy().astype(bool)
        cu = s["cu_seqlens"].numpy()
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            seg = ids[a:b + 1] if b == ids.size - 1 else ids[a:b]
            hit = known.get(tuple(seg.tolist()))
            if hit is None:  # the bin's free room
                assert np.all(seg == spec.pad_id) and not keep[a:b].any()
                continue
            example, mask = hit
            n = example.size
            assert keep[a:a + n - 1].tolist() == mask[1:n].tolist()  # answers only, as written
            seen.append(n)
    assert sorted(seen) == sorted(e.size for e in synth["examples"])  # every example once, whole
    stored = build_datasets(config(synth, recipe_options(tokenizer_dir, "--apertus-sft-data", prefix,
                                                         "--apertus-sft-mask", "stored"), spec, [prefix]),
                            [None, None, None])[0]
    for i in range(train.num_bins):
        assert np.array_equal(stored[i]["loss_mask"].numpy(), train[i]["loss_mask"].numpy())


def test_blended_with_long_documents(synth: dict[str, Any], tokenizer_dir: Path, spec: VocabSpec,
                                     process_group: None) -> None:
    opts = recipe_options(tokenizer_dir, "--apertus-sft-data", synth["prefix"], "--apertus-bfd-data", synth["pre"])
    train = build_datasets(ApertusDatasetConfig(
        random_seed=5, sequence_length=SEQ, blend=([synth["pre"], synth["prefix"]], [0.8, 0.2]), split="100,0,0",
        tokenizer=null_tokenizer(spec.size), create_attention_mask=False, path_to_cache=str(synth["root"] / "cache2"),
        mid_level_dataset_surplus=0.5, apertus=opts), [12, 0, 0])[0]
    trained = [int(train[i]["loss_mask"].sum()) for i in range(len(train))]
    assert len(trained) >= 12 and all(t > 0 for t in trained)
    assert set(np.unique(train.dataset_index[: len(train)]).tolist()) == {0, 1}  # both prefixes sampled
