"""How long the full-size Apertus 1.5 tokenizer takes to load, per installed ``tokenizers`` version.

The released tokenizer holds 266,440 entries, most of them added tokens (the image and audio codes
and the omni block); ``tokenizers`` releases before 0.22.2 load such a file slowly (the tokenizer
repository reports 1-3 minutes). This writes the test tokenizer at the released sizes (the same
layout and added tokens; a small merge table) and times ``Tokenizer.from_file`` in a fresh process
of each interpreter given (one per ``tokenizers`` version), then encodes one line with it.

    python benchmarks/bench_tokenizer_load.py [--python /path/to/venv/bin/python ...] [--repeat 2]

Without ``--python`` it times the interpreter running it. Prints one row per interpreter: the
version, the best load time over the repeats, and the ratio to the fastest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE = r"""
import json, sys, time
import tokenizers
t0 = time.perf_counter()
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
load = time.perf_counter() - t0
ids = tok.encode("Grüezi <|image|> mitenand").ids
print(json.dumps({"version": tokenizers.__version__, "load_s": load, "size": tok.get_vocab_size(), "ids": len(ids)}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", default=[], help="an interpreter to time (repeatable)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)

    from apertus_plugins.core.vocab import default_spec
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    pythons = args.python or [sys.executable]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_test_tokenizer(Path(tmp) / "tok", default_spec(), with_templates=False)
        path = str(Path(folder) / "tokenizer.json")
        size = Path(path).stat().st_size
        rows = []
        for py in pythons:
            best, info = None, {}
            for _ in range(max(1, args.repeat)):
                out = subprocess.run([py, "-c", PROBE, path], capture_output=True, text=True, timeout=1800)
                if out.returncode != 0:
                    info = {"version": "?", "error": out.stderr.strip().splitlines()[-1:]}
                    break
                info = json.loads(out.stdout.strip().splitlines()[-1])
                best = info["load_s"] if best is None else min(best, info["load_s"])
            rows.append((py, info, best))
    fastest = min((b for _, _, b in rows if b is not None), default=None)
    print(f"full-size test tokenizer: {size / 2**20:.1f} MiB tokenizer.json; best of {args.repeat} fresh processes")
    print(f"{'tokenizers':<12}{'load':>10}{'vs fastest':>12}  entries")
    for py, info, best in rows:
        if best is None:
            print(f"{info.get('version', '?'):<12}{'failed':>10}  {py}: {info.get('error')}")
            continue
        print(f"{info['version']:<12}{best:>9.2f}s{best / fastest:>11.1f}x  {info['size']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
