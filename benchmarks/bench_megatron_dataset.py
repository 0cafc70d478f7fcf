"""Cost of the Apertus samples next to upstream's, in the megatron environment (CPU, one process).

    python3 tools/dev.py run megatron python benchmarks/bench_megatron_dataset.py [--seq 8192 32768 ...]

Builds one pretraining prefix and one SFT prefix, then times ``__getitem__`` of megatron-core's
``GPTDataset`` and of ``ApertusDataset`` (pretraining targets with and without Goldfish;
pretraining documents and SFT conversations packed best-fit-decreasing with
``--apertus-packed-sequences``, as the long-context stages run, the SFT mask derived on the fly),
all built by ``BlendedMegatronDatasetBuilder``, at each sequence length (default 32,768, 131,072
and 262,144 tokens). Prints CPU milliseconds per sample (``time.process_time``: other jobs on a
shared machine barely move it), the ratio to upstream and the peak of the numpy allocations made
while building one sample (tracemalloc): linear in the sequence length.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")


def main() -> None:
    from apertus_plugins.core.release import CONTEXT_LENGTH

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[32768, 131072, CONTEXT_LENGTH])
    ap.add_argument("--samples", type=int, default=10, help="samples timed per dataset and length")
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
        for _ in range(6000):
            doc = rng.integers(80, spec.size, int(rng.integers(200, 3000)))
            w.add_document(np.concatenate([[spec.bos_id], doc, [spec.eos_id]]))
    with IndexedDatasetWriter(sft, np.uint16) as w:
        for _ in range(6000):
            turns = []
            for _ in range(int(rng.integers(1, 6))):
                turns += [{"role": "user", "content": " ".join(rng.choice(words, 30))},
                          {"role": "assistant", "content": " ".join(rng.choice(words, int(rng.integers(20, 300))))}]
            w.add_document(chat.encode_conversation(turns, variant="training").ids)
    mtok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=spec.size)

    def opts(*flags: str):  # noqa: ANN202
        return options_from_args(add_apertus_args(argparse.ArgumentParser()).parse_args(
            ["--apertus-tokenizer", str(tok), *flags]))

    def timed(ds) -> tuple[float, float]:  # noqa: ANN001
        n = min(a.samples, len(ds))
        for i in range(n + 1):  # an untimed pass first: the .bin pages are read in, the caches built
            ds[i % len(ds)]
        t = time.process_time()  # CPU time: other jobs on a shared machine barely move it
        for i in range(1, n + 1):
            ds[i % len(ds)]
        ms = (time.process_time() - t) / n * 1e3
        tracemalloc.start()
        ds[1 % len(ds)]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return ms, peak / 2**20

    print(f"{a.samples} samples each, one CPU process, CPU ms per sample; peak: numpy allocations while building "
          "one sample")
    for seq in a.seq:
        common = {"random_seed": 1, "sequence_length": seq, "split": "100,0,0", "tokenizer": mtok,
                  "path_to_cache": str(root / "cache")}
        upstream = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, GPTDatasetConfig(
            blend=([pre], None), reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
            create_attention_mask=False, **common)).build()[0]
        rows = [("upstream GPTDataset (reset positions/attention, eod mask)", *timed(upstream))]
        for label, flags, prefix in [
            ("Apertus pretraining (targets, EOD rule)", (), pre),
            ("Apertus pretraining + Goldfish k=50 h=50", ("--apertus-goldfish-k", "50"), pre),
            ("Apertus packed pretraining (BFD, cu_seqlens) + Goldfish",
             ("--apertus-bfd-data", pre, "--apertus-packed-sequences", "--apertus-goldfish-k", "50"), pre),
            ("Apertus SFT: BFD packing, mask derived, cu_seqlens",
             ("--apertus-sft-data", sft, "--apertus-packed-sequences"), sft),
            ("Apertus SFT as above, padded for CP 16 (multiple 32)",
             ("--apertus-sft-data", sft, "--apertus-packed-sequences", "--apertus-pad-to-multiple", "32"), sft),
        ]:
            # Megatron's default asks for attention masks; packed sequences never build one ([S, S] at 262k: 64 GiB)
            packed = "--apertus-packed-sequences" in flags
            cfg = ApertusDatasetConfig(blend=([prefix], None), create_attention_mask=packed, apertus=opts(*flags),
                                       **common)
            rows.append((label, *timed(build_datasets(cfg, [None, None, None])[0])))
        base = rows[0][1]
        print(f"\nsequence length {seq:,}")
        for label, ms, peak in rows:
            print(f"  {label:58s} {ms:9.2f} ms/sample   x{ms / base:6.2f}   peak {peak:7.1f} MiB")


if __name__ == "__main__":
    main()
