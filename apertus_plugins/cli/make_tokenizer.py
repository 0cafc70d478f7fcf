"""``apertus make-tokenizer DIR``: write a small test tokenizer with the exact 1.5 layout."""

from __future__ import annotations

import argparse

from apertus_plugins import plugins
from apertus_plugins.core.vocab import VocabSpec, default_spec
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tokenizer", help="write a test tokenizer with the Apertus 1.5 id layout",
                       description="Write a Hugging Face fast tokenizer directory with the Apertus 1.5 layout "
                                   "(chat tokens, thinking delimiters, omni block, code tokens) and the chat "
                                   "templates. Scaled down by default; --full writes the released sizes.")
    p.add_argument("dir")
    p.add_argument("--full", action="store_true", help="the released sizes (266,440 entries)")
    p.add_argument("--text-size", type=int, default=512)
    p.add_argument("--image-codes", type=int, default=256)
    p.add_argument("--audio-codes", type=int, default=64)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.full:
        spec = default_spec()
    else:
        spec = VocabSpec.scaled(text_size=args.text_size, image_codes=args.image_codes, audio_codes=args.audio_codes)
    spec = plugins.spec(spec)  # the installed modalities' omni slots, as the released tokenizer would carry them
    out = build_test_tokenizer(args.dir, spec)
    print(f"wrote {out} ({spec.size} entries)")
    return 0
