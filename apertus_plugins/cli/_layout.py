"""The vocabulary a generating command writes: ``--full`` (the released layout) or the scaled-down one."""

from __future__ import annotations

import argparse

from apertus_plugins import plugins
from apertus_plugins.core.vocab import VocabSpec, default_spec


def add_layout_args(p: argparse.ArgumentParser, *, full_help: str) -> None:
    """``--full`` and the sizes of the scaled vocabulary (``--text-size``, ``--image-codes``, ``--audio-codes``)."""
    p.add_argument("--full", action="store_true", help=full_help)
    p.add_argument("--text-size", type=int, default=512, help="text ids of the scaled vocabulary")
    p.add_argument("--image-codes", type=int, default=256, help="image codes of the scaled vocabulary")
    p.add_argument("--audio-codes", type=int, default=64, help="audio codes of the scaled vocabulary")


def layout_spec(args: argparse.Namespace) -> VocabSpec:
    """The layout :func:`add_layout_args` chose, with the installed modalities' omni slots (as the released
    tokenizer would carry them)."""
    if args.full:
        spec = default_spec()
    else:
        spec = VocabSpec.scaled(text_size=args.text_size, image_codes=args.image_codes, audio_codes=args.audio_codes)
    return plugins.spec(spec)
