"""Time per training iteration on CPU: the Apertus spec through ``apertus-megatron`` vs megatron-core's stock GPT, and where the difference goes.

    python3 tools/dev.py run megatron-train python benchmarks/bench_megatron_train.py [--sizes tiny large]

Every run is Megatron's real ``pretrain()`` loop (one process, one thread, gloo, the megatron-train
suite's CPU harness) on the same model shape and the same data (the suite's blend of images, audio
and text, tokenized by ``apertus tokenize``), float32:

* ``stock GPT``: ``pretrain_gpt.py`` run directly: megatron-core's local GPT layer spec (GeLU MLP;
  QK-norm and RMSNorm from the same flags), ``GPTDataset``, upstream's loss;
* ``Apertus, xIELU composed``: through ``apertus-megatron`` with the xIELU formula as a composition
  of torch operations (how the spec ran it before, ``APERTUS_TEST_XIELU=composed``);
* ``Apertus``: through ``apertus-megatron`` as shipped: the fused xIELU (one autograd function that
  keeps only its input), ``ApertusDataset`` (loss targets, Goldfish k=50, end-of-document rule,
  position resets, cross-document attention masks), the weighted loss with per-modality reports
  and the target check of each step.

Sizes: ``tiny`` (2 layers, hidden 64, sequence 64, micro batch 4) and ``large`` (2 layers, hidden
1024, FFN 4096, sequence 1024, micro batch 1: matrix work dominates, as at scale). The runs are
interleaved (``--repeats``) so that the load of a shared machine spreads over all three. Two times
per iteration, each the median after the first ``--warmup`` iterations: the CPU time of the
training step (``time.process_time`` around Megatron's ``train_step``, printed by the harness:
the runs are single-threaded, so other jobs on the machine barely move it; the ratio to read) and
Megatron's own wall-clock ``elapsed time per iteration``. The two Apertus runs must log identical losses (the fused xIELU has the
formula's values and gradients bit for bit); the script says whether they do.

Then the breakdown at each size, measured in this process on the same tensor shapes (one thread),
per training iteration: the MLP activation (GeLU / xIELU composed / xIELU fused, forward and
backward, and the activation memory the MLP keeps for backward), QK-norm (present in both specs),
the loss (upstream's masked sum vs the Apertus loss with modality weights and per-modality
sums), and a sample of the dataset (``GPTDataset`` vs ``ApertusDataset`` with Goldfish). Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "megatron-train"))

from conftest import build_data, cpu_env, model_flags, torchrun, train_flags  # noqa: E402  (the suite's helpers, put on the path just above: this script runs by path)


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    ffn: int
    seq: int
    mbs: int
    iters: int
    layers: int = 2
    heads: int = 4
    groups: int = 2


SIZES = {"tiny": Size("tiny", 64, 128, 64, 4, 40), "large": Size("large", 1024, 4096, 1024, 1, 12)}
RUNS = ("stock GPT", "Apertus, xIELU composed", "Apertus")


def ms_per_iteration(log: str) -> list[float]:
    """Megatron's wall time per iteration, in order."""
    import re

    return [float(m) for m in re.findall(r"elapsed time per iteration \(ms\):\s*([0-9.]+)", log)]


def cpu_ms_per_iteration(log: str) -> list[float]:
    """The CPU time of each training step (the harness's ``APERTUS_TEST_STEP_CPU_TIME``), in order."""
    import re

    return [float(m) for m in re.findall(r"\[cpu_patches\] iteration \d+ cpu ms ([0-9.]+)", log)]


def _drop_apertus(flags: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for tok in flags:
        if tok.startswith("--"):
            skip = tok.startswith("--apertus-")
        if not skip:
            out.append(tok)
    return out


def full_runs(data: Any, root: Path, size: Size, repeats: int, warmup: int) -> dict[str, Any]:
    common = [*model_flags(layers=size.layers, hidden=size.hidden, heads=size.heads, groups=size.groups,
                           ffn=size.ffn, seq=size.seq),
              *train_flags(data, iters=size.iters, mbs=size.mbs, gbs=size.mbs),
              "--data-path", "0.5", data.images, "0.2", data.audio, "0.3", data.text]
    apertus = [*common, "--apertus-goldfish-k", "50"]
    plan = {"stock GPT": (False, _drop_apertus(common), cpu_env(APERTUS_TEST_STEP_CPU_TIME="1")),
            "Apertus, xIELU composed": (True, apertus, cpu_env(APERTUS_TEST_STEP_CPU_TIME="1",
                                                               APERTUS_TEST_XIELU="composed")),
            "Apertus": (True, apertus, cpu_env(APERTUS_TEST_STEP_CPU_TIME="1"))}
    wall: dict[str, list[float]] = {k: [] for k in RUNS}
    cpu: dict[str, list[float]] = {k: [] for k in RUNS}
    losses: dict[str, dict[int, float]] = {}
    for _ in range(repeats):
        for name in RUNS:
            plugin, flags, env = plan[name]
            run = torchrun(flags, plugin=plugin, cwd=root, env=env, timeout=3600)
            wall[name] += ms_per_iteration(run.log)[warmup:]
            cpu[name] += cpu_ms_per_iteration(run.log)[warmup:]
            losses[name] = run.losses()
    return {"ms": {k: statistics.median(v) for k, v in wall.items()},
            "cpu ms": {k: statistics.median(v) for k, v in cpu.items()},
            "identical losses": losses["Apertus"] == losses["Apertus, xIELU composed"],
            "losses": losses["Apertus"]}


# ------------------------------------------------------------------------------------------ breakdown
def _timed(fn: Callable[[], Any], repeat: int = 5) -> float:
    """Median CPU milliseconds of ``fn`` (this process, one thread)."""
    fn()
    samples = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        samples.append(time.process_time() - t)
    return statistics.median(samples) * 1e3


def breakdown(data: Any, root: Path, size: Size) -> list[tuple[str, float, float, str]]:
    """Rows ``(component, stock ms per iteration, Apertus ms per iteration, note)``."""
    import numpy as np
    import torch

    from apertus_plugins.core import xielu
    from apertus_plugins.core.vocab import VocabSpec
    from apertus_plugins.testing.memory import saved_tensor_bytes
    from megatron_patches.training import loss_func

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tokens = size.seq * size.mbs
    rows: list[tuple[str, float, float, str]] = []
    # the MLP: fc1 -> activation -> fc2, forward and backward, and what it keeps for backward
    fc1 = torch.nn.Linear(size.hidden, size.ffn, bias=False)
    fc2 = torch.nn.Linear(size.ffn, size.hidden, bias=False)
    x = torch.randn(tokens, size.hidden, generator=g)
    p, n = (t.requires_grad_() for t in xielu.initial_parameters())
    beta, eps = torch.tensor(xielu.BETA), torch.tensor(xielu.EPS)
    acts = {"GeLU": torch.nn.functional.gelu, "xIELU composed": lambda h: xielu.xielu(h, p, n, beta, eps),
            "xIELU fused": lambda h: xielu.xielu_fused(h, p, n, beta, eps)}
    params = [*fc1.parameters(), *fc2.parameters(), p, n]
    act_ms, mlp_mib = {}, {}
    h = torch.randn(tokens, size.ffn, generator=g)
    grad = torch.randn(tokens, size.ffn, generator=g)
    for name, act in acts.items():
        def activation(act: Callable[[Any], Any] = act) -> None:
            hi = h.clone().requires_grad_()
            act(hi).backward(grad)
        act_ms[name] = _timed(activation) * size.layers
        mlp_mib[name] = saved_tensor_bytes(lambda act=act: fc2(act(fc1(x.requires_grad_()))), params) / 2**20
    rows.append(("MLP activation, fwd+bwd (before: composed)", act_ms["GeLU"], act_ms["xIELU composed"],
                 f"MLP keeps {mlp_mib['GeLU']:.1f} MiB (GeLU) vs {mlp_mib['xIELU composed']:.1f} MiB per layer"))
    rows.append(("MLP activation, fwd+bwd (after: fused)", act_ms["GeLU"], act_ms["xIELU fused"],
                 f"MLP keeps {mlp_mib['GeLU']:.1f} MiB (GeLU) vs {mlp_mib['xIELU fused']:.1f} MiB per layer"))
    # QK-norm: RMSNorm of q and k per head (both specs have it: the flags say --qk-layernorm)
    d = size.hidden // size.heads
    q = torch.randn(tokens, size.heads, d, generator=g)
    k = torch.randn(tokens, size.groups, d, generator=g)
    w = torch.ones(d, requires_grad=True)

    def qk_norm() -> None:
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = torch.nn.functional.rms_norm(qi, (d,), w, 1e-5).sum() + torch.nn.functional.rms_norm(ki, (d,), w, 1e-5).sum()
        out.backward()
    qk = _timed(qk_norm) * size.layers
    rows.append(("QK-norm, fwd+bwd (in both specs)", qk, qk, "same flags: --qk-layernorm"))
    # the loss of a micro-batch
    spec = VocabSpec.scaled()
    losses = torch.rand(1, tokens, generator=g).requires_grad_()
    mask = (torch.rand(1, tokens, generator=g) > 0.1).float()
    modality = torch.from_numpy(np.random.default_rng(0).integers(0, len(spec.modality_names), (1, tokens)))
    weights = torch.ones(len(spec.modality_names))

    def upstream_loss() -> None:
        out = losses.view(-1).float()
        loss = torch.sum(out * mask.view(-1))
        num = mask.sum().clone().detach().to(torch.int)
        _ = {"lm loss": torch.cat([loss.clone().detach().view(1), num.view(1)])}
        loss.backward()

    def apertus_loss() -> None:
        loss, _, _ = loss_func(mask, modality, losses, weights=weights, names=spec.modality_names)
        loss.backward()
    rows.append(("loss of a micro-batch, fwd+bwd", _timed(upstream_loss), _timed(apertus_loss),
                 "Apertus: modality weights, per-modality sums, target counts"))
    # a sample of the dataset (Megatron reads one per micro-batch; num-workers 0)
    rows.append(("dataset sample (x micro batch)", *(_sample_ms(data, root, size, goldfish) * size.mbs
                                                     for goldfish in (None, 50)),
                 "GPTDataset vs ApertusDataset (targets, Goldfish k=50, positions, [S, S] mask)"))
    return rows


def _sample_ms(data: Any, root: Path, size: Size, goldfish: int | None) -> float:
    import argparse as ap

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    from megatron_patches.arguments import add_apertus_args, options_from_args
    from megatron_patches.checkpoint import single_process_group
    from megatron_patches.dataset import ApertusDatasetConfig, build_datasets

    single_process_group()
    tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=data.vocab)
    common = {"random_seed": 1, "sequence_length": size.seq, "split": "100,0,0", "tokenizer": tok,
              "path_to_cache": str(root / "cache"), "create_attention_mask": True,
              "blend": ([data.images, data.audio, data.text], [0.5, 0.2, 0.3])}
    if goldfish is None:
        ds = BlendedMegatronDatasetBuilder(GPTDataset, [64, 0, 0], lambda: True, GPTDatasetConfig(
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, **common)).build()[0]
    else:
        flags = ["--apertus-tokenizer", str(data.tokenizer), "--apertus-goldfish-k", str(goldfish)]
        opts = options_from_args(add_apertus_args(ap.ArgumentParser()).parse_args(flags))
        ds = build_datasets(ApertusDatasetConfig(apertus=opts, **common), [64, 0, 0])[0]
    return _timed(lambda: [ds[i] for i in range(16)]) / 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds of the three runs")
    ap.add_argument("--warmup", type=int, default=3, help="iterations left out of each run's median")
    ap.add_argument("--iters", type=int, default=None, help="iterations per run (default: per size)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-megatron-train-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        data = build_data(root)
        print(f"data written in {time.perf_counter() - t0:.1f} s (apertus tokenize pretrain/sft, manifest)")
        for name in args.sizes:
            size = SIZES[name]
            if args.iters:
                size = Size(**{**size.__dict__, "iters": args.iters})
            result = full_runs(data, root, size, args.repeats, args.warmup)
            parts = breakdown(data, root, size)
            print(f"\n== {size.name}: {size.layers} layers, hidden {size.hidden}, FFN {size.ffn}, sequence {size.seq}, "
                  f"micro batch {size.mbs}; {size.iters} iterations x {args.repeats} interleaved runs each, median "
                  f"after {args.warmup}, one thread, float32")
            stock, stock_cpu = result["ms"]["stock GPT"], result["cpu ms"]["stock GPT"]
            print(f"  {'':26s} {'CPU ms/iter':>12s} {'ratio':>7s}   {'wall ms/iter':>12s} {'ratio':>7s}")
            for run in RUNS:
                ms, cpu = result["ms"][run], result["cpu ms"][run]
                print(f"  {run:26s} {cpu:12.1f} {cpu / stock_cpu:6.3f}x   {ms:12.1f} {ms / stock:6.3f}x")
            print(f"  Apertus losses identical with the composed and the fused xIELU: {result['identical losses']} "
                  f"({len(result['losses'])} iterations)")
            print(f"  breakdown per iteration (CPU ms, this process){'':6s} {'stock':>9s} {'Apertus':>9s} {'delta':>9s}")
            for label, a, b, note in parts:
                print(f"    {label:44s} {a:9.1f} {b:9.1f} {b - a:+9.1f}   {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
