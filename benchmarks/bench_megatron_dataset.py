"""Cost of the Apertus samples next to upstream's, in the megatron environment (CPU, one process).

    python3 tools/dev.py run megatron python benchmarks/bench_megatron_dataset.py [--seq 8192]

Builds one pretraining prefix and one SFT prefix, then times ``__getitem__`` of megatron-core's
``GPTDataset`` and of ``ApertusDataset`` (pretraining targets with and without Goldfish; SFT
packing with the mask derived on the fly and read from a stored stream), all built by
``BlendedMegatronDatasetBuilder``. Prints milliseconds per sample and the ratio to upstream.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=200)
    a = ap.parse_args()

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    from apertus_plugins.core.chat import ChatTokenizer
    from apertus_plugins.core.vocab import VocabSpec
    from apertus_plugins.data.indexed import IndexedDatasetWriter
    from apertus_plugins.testing.tokenizer_builder import SAMPLE_CORPUS, build_test_tokenizer
    from megatron_patches.arguments import add_apertus_args, options_from_args
    from megatron_patches.checkpoint import single_process_group
    from megatron_patches.dataset import ApertusDatasetConfig, build_datasets

    single_process_group()
    root = Path(tempfile.mkdtemp(prefix="bench-megatron-"))
    spec = VocabSpec.scaled()
    tok = build_test_tokenizer(root / "tok", spec, with_templates=False)
    chat = ChatTokenizer(tok)
    rng = np.random.default_rng(0)
    words = SAMPLE_CORPUS.split()
    pre, sft = str(root / "pre"), str(root / "sft")
    with IndexedDatasetWriter(pre, np.uint16) as w:
        for _ in range(4000):
            doc = rng.integers(80, spec.size, int(rng.integers(200, 3000)))
            w.add_document(np.concatenate([[spec.bos_id], doc, [spec.eos_id]]))
    with IndexedDatasetWriter(sft, np.uint16) as w:
        for _ in range(3000):
            turns = []
            for _ in range(int(rng.integers(1, 6))):
                turns += [{"role": "user", "content": " ".join(rng.choice(words, 30))},
                          {"role": "assistant", "content": " ".join(rng.choice(words, int(rng.integers(20, 300))))}]
            w.add_document(chat.encode_conversation(turns, variant="training").ids)
    mtok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=spec.size)
    common = {"random_seed": 1, "sequence_length": a.seq, "split": "100,0,0", "tokenizer": mtok,
              "path_to_cache": str(root / "cache")}

    def opts(*flags: str):  # noqa: ANN202
        return options_from_args(add_apertus_args(argparse.ArgumentParser()).parse_args(
            ["--apertus-tokenizer", str(tok), *flags]))

    def timed(ds) -> float:  # noqa: ANN001
        n = min(a.samples, len(ds))
        ds[0]
        t = time.perf_counter()
        for i in range(n):
            ds[i]
        return (time.perf_counter() - t) / n * 1e3

    upstream = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, GPTDatasetConfig(
        blend=([pre], None), reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
        create_attention_mask=False, **common)).build()[0]
    rows = [("upstream GPTDataset (reset positions/attention, eod mask)", timed(upstream))]
    for label, flags, prefix in [
        ("Apertus pretraining (targets, EOD rule)", (), pre),
        ("Apertus pretraining + Goldfish k=50 h=50", ("--apertus-goldfish-k", "50"), pre),
        ("Apertus SFT: BFD packing, mask derived", ("--apertus-sft-data", sft), sft),
    ]:
        cfg = ApertusDatasetConfig(blend=([prefix], None), create_attention_mask=False, apertus=opts(*flags), **common)
        rows.append((label, timed(build_datasets(cfg, [None, None, None])[0])))
    base = rows[0][1]
    print(f"sequence length {a.seq}, {a.samples} samples each, one CPU process")
    for label, ms in rows:
        print(f"  {label:58s} {ms:8.3f} ms/sample   x{ms / base:5.2f}")


if __name__ == "__main__":
    main()
