"""``apertus vocab DIR``: a summary of a tokenizer directory's id layout."""

from __future__ import annotations

import argparse
import json

from apertus_plugins import plugins


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vocab", help="summarize a tokenizer directory's id layout",
                       description="Read a tokenizer directory (tokenizer.json + tokenizer_config.json) and "
                                   "print its Apertus 1.5 id layout; exits 1 if the layout is inconsistent.")
    p.add_argument("dir", help="tokenizer directory (or a checkpoint directory holding one), or a Hub id ORG/NAME[@REV]")
    p.add_argument("--embedding-rows", type=int, default=None, help="check that the layout fits this embedding")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from apertus_plugins.infra.hub import local_path

    spec = plugins.spec_from_tokenizer_dir(local_path(args.dir, weights=False, what="tokenizer"),
                                           embedding_rows=args.embedding_rows)
    summary = spec.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"tokenizer      {args.dir}")
    print(f"length         {summary['tokenizer_length']}  (layout needs {summary['total']})")
    if summary["embedding_rows"] is not None:
        print(f"embedding rows {summary['embedding_rows']}")
    print(f"text           {summary['text'][0]}..{summary['text'][1]}")
    print(f"omni block     {summary['omni'][0]}..{summary['omni'][1]}")
    for name, (lo, hi) in summary["modalities"].items():
        print(f"{name:14s} {lo}..{hi}  ({hi - lo + 1} codes)")
    print("chat tokens    " + ", ".join(f"{n}={i}" for n, i in summary["chat"].items()))
    print("omni markers   " + ", ".join(f"{n}={i}" for n, i in summary["markers"].items()))
    print(f"special ids    {summary['special_ids']} (of which {summary['extra_special_ids']} reserved "
          "by the tokenizer below the text boundary)")
    return 0
