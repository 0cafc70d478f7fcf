"""SDPO loss: time and peak memory of the chunked top-k/tail path against a naive full-softmax reverse KL.

Both compute forward + backward from final hidden states and an LM head with the real Apertus
text vocabulary (131,072 output rows). The efficient path is
:func:`apertus_plugins.core.losses.topk_tail_reverse_kl_from_hidden` (logits built and rebuilt
chunk by chunk, never whole); the naive path materializes the full student and teacher logits,
log-softmaxes both and sums ``q (log q - log r)`` over the vocabulary.

Each measurement runs in a fresh subprocess. On CPU the peak is the process's peak resident
memory above what it held once the inputs were allocated (``ru_maxrss``); on CUDA it is
``torch.cuda.max_memory_allocated`` above the inputs. A size whose naive logits do not fit
is skipped by ``--naive-max-tokens`` and said so; for it the line below the row gives the size of the
naive path's two float32 logit matrices, computed and labelled so. Every other number is measured.

    python3 tools/dev.py run verl python benchmarks/bench_sdpo_loss.py                    # CPU sizes
    python benchmarks/bench_sdpo_loss.py --device cuda --tokens 65536 --naive-max-tokens 65536
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from apertus_plugins.core.losses import topk_tail_reverse_kl_from_hidden
mode, n, h, v, k, chunk, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
torch.manual_seed(0)
hs = torch.randn(n, h, device=device, requires_grad=True)
ht = torch.randn(n, h, device=device)
w = (torch.randn(v, h, device=device) * h ** -0.5).requires_grad_(True)
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
else:
    base = rss()
t0 = time.perf_counter()
if mode == "naive":
    s = torch.log_softmax(hs @ w.t(), -1)
    with torch.no_grad():
        t = torch.log_softmax(ht @ w.detach().t(), -1)
    loss = (s.exp() * (s - t)).sum(-1).mean()
else:
    loss = topk_tail_reverse_kl_from_hidden(hs, ht, w, k=k, chunk_size=chunk).mean()
loss.backward()
if device == "cuda":
    torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
else:
    peak = rss() - base
print("RESULT" + json.dumps({"seconds": time.perf_counter() - t0, "peak_bytes": peak, "loss": float(loss)}))
"""


def run(mode: str, n: int, args: argparse.Namespace) -> dict | None:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(n), str(args.hidden), str(args.vocab), str(args.k),
                          str(args.chunk), args.device], capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        print(f"  {mode} at {n} tokens failed:\n{out.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads(line[6:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096],
                    help="response-token counts to measure (the target batch is 16 x 4,096 = 65,536)")
    ap.add_argument("--naive-max-tokens", type=int, default=4096,
                    help="largest token count the naive path is run at (its logits must fit in memory)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=131072, help="output vocabulary (Apertus text rows: 131,072)")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    print(f"SDPO loss fwd+bwd, vocab {args.vocab}, hidden {args.hidden}, top-k {args.k}, chunk {args.chunk}, "
          f"device {args.device}")
    print(f"{'tokens':>8} {'naive s':>9} {'naive MiB':>10} {'chunked s':>10} {'chunked MiB':>12} {'mem ratio':>10}")
    for n in args.tokens:
        eff = run("chunked", n, args)
        nai = run("naive", n, args) if n <= args.naive_max_tokens else None
        mib = 2 ** 20
        row = f"{n:>8} "
        row += f"{nai['seconds']:>9.2f} {nai['peak_bytes'] / mib:>10.0f} " if nai else f"{'(not run)':>9} {'':>10} "
        row += f"{eff['seconds']:>10.2f} {eff['peak_bytes'] / mib:>12.0f} " if eff else f"{'failed':>10} {'':>12} "
        if nai and eff:
            row += f"{eff['peak_bytes'] / max(nai['peak_bytes'], 1):>10.3f}"
        print(row, flush=True)
        if nai is None:
            # not a measurement: the size of the two float32 logit matrices the naive path must hold at once
            floor = 2 * n * args.vocab * 4 / mib
            line = f"{'':>8} naive not run at {n} tokens: its student and teacher logits alone are {floor:.0f} MiB"
            if eff:
                line += f" (computed), {eff['peak_bytes'] / mib / floor:.3f} of that measured for the chunked path"
            print(line, flush=True)


if __name__ == "__main__":
    main()
