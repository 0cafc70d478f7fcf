"""``apertus make-tokenizer DIR``: write a small test tokenizer with the exact 1.5 layout."""

from __future__ import annotations

import argparse

from apertus_plugins.cli._layout import add_layout_args, layout_spec
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tokenizer", help="write a test tokenizer with the Apertus 1.5 id layout",
                       description="Write a Hugging Face fast tokenizer directory with the Apertus 1.5 layout "
                                   "(chat tokens, thinking delimiters, omni block, code tokens) and the chat "
                                   "templates. Scaled down by default; --full writes the released sizes.")
    p.add_argument("dir")
    add_layout_args(p, full_help="the released sizes (266,440 entries)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spec = layout_spec(args)
    out = build_test_tokenizer(args.dir, spec)
    print(f"wrote {out} ({spec.size} entries)")
    return 0
