"""``apertus inspect PREFIX --index N``: what one document of a Megatron indexed dataset trains.

With ``--json`` prints ``{"ids": [...], "sft_mask": [...], "goldfish_drop": [...]}``; both lists
are indexed by label position ``j`` (label ``j`` is ``ids[j+1]``). Without it prints the tokens
for a person checking a dataset: coloured by role and training state on a terminal (``NO_COLOR``
turns colours off), each image or audio span collapsed to one line (``[image 87x87 · 7,569 codes ·
training layout]``), then the counts per role. ``--html FILE`` writes the same document as one
self-contained page: tokens coloured by role and marked trained/untrained/dropped by Goldfish,
images as their code grids, clips as code strips, a legend and the per-role counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from apertus_plugins import plugins
from apertus_plugins.core.goldfish import VARIANTS, goldfish_drop
from apertus_plugins.core.targets import sft_mask
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.data.indexed import IndexedDataset


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show what one document of an indexed dataset trains",
        description="Read document N of a Megatron indexed dataset (PREFIX.bin/.idx) and show its ids with "
        "the SFT mask and the Goldfish drops, both indexed by label position j (label j is ids[j+1]). Media spans "
        "are shown whole, one line each; NO_COLOR=1 turns the terminal colours off.",
    )
    p.add_argument("prefix", help="dataset prefix (PREFIX.bin and PREFIX.idx)")
    p.add_argument("--index", type=int, default=0, help="document index (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--html", metavar="FILE", help="also write the document as a self-contained HTML page")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or Hub id (layout and decoding); default VocabSpec()")
    p.add_argument("--goldfish-k", type=int, default=50, help="Goldfish k (default 50)")
    p.add_argument("--goldfish-h", type=int, default=50, help="Goldfish h (default 50)")
    p.add_argument("--goldfish-variant", choices=VARIANTS, default="hashtable", help="Goldfish variant")
    p.add_argument("--start-inside", choices=("auto", "none", "assistant", "tool_output"), default="auto",
                   help="SFT state before the first token (default: inferred)")
    p.set_defaults(func=run)


def inspect_document(
    prefix: str, index: int, spec: VocabSpec, *, k: int = 50, h: int = 50, variant: str = "hashtable",
    start_inside: str = "auto",
) -> dict[str, list[int] | list[bool]]:
    """The ``--json`` object for document ``index`` of ``prefix``."""
    ds = IndexedDataset(prefix)
    ids = np.asarray(ds.document(index), dtype=np.int64)
    mask = sft_mask(ids, spec, start_inside=start_inside)  # type: ignore[arg-type]
    drop = goldfish_drop(ids[1:], k=k, h=h, variant=variant, spec=spec)
    return {"ids": ids.tolist(), "sft_mask": mask.tolist(), "goldfish_drop": drop.tolist()}


def use_color(stream: object = None) -> bool:
    """Colours on a terminal unless ``NO_COLOR`` is set to anything but the empty string (no-color.org)."""
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def run(args: argparse.Namespace) -> int:
    from ._view import document_view, render_html, render_text

    if args.tokenizer:
        from apertus_plugins.infra.hub import local_path

        args.tokenizer = str(local_path(args.tokenizer, weights=False, what="--tokenizer"))
    spec = plugins.spec_from_tokenizer_dir(args.tokenizer) if args.tokenizer else plugins.spec()
    out = inspect_document(args.prefix, args.index, spec, k=args.goldfish_k, h=args.goldfish_h,
                           variant=args.goldfish_variant, start_inside=args.start_inside)
    if args.json and not args.html:
        print(json.dumps(out))
        return 0
    goldfish = f"k={args.goldfish_k}, h={args.goldfish_h}, {args.goldfish_variant}"
    view = document_view(out["ids"], out["sft_mask"], out["goldfish_drop"], spec, _decoder(args.tokenizer),
                         title=f"{args.prefix} · document {args.index}", goldfish=goldfish)
    if args.html:
        path = Path(args.html)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(render_html(view), encoding="utf-8")
        tmp.replace(path)  # never a half-written page
    if args.json:
        print(json.dumps(out))
    else:
        print(render_text(view, use_color()))
    if args.html:
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _decoder(tokenizer_dir: str | None):  # type: ignore[no-untyped-def]
    if not tokenizer_dir:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda tid: tok.decode([tid], skip_special_tokens=False)
