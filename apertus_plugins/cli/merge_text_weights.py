"""``apertus merge-text-weights TRAINED RELEASED OUT``: trained text weights back into a released checkpoint."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge-text-weights", help="put trained decoder and head weights back into a released checkpoint",
        description="Write OUT: the released Apertus 1.5 checkpoint RELEASED with its language model and LM head "
                    "(model.language_model.*, lm_head.weight) replaced by those of TRAINED (a Hugging Face "
                    "directory saved from a text-only run, e.g. verl's model merger or hf_model checkpoint of "
                    "Apertus1p5ForCausalLM), each in the released tensor's dtype. The vision and audio tokenizers, "
                    "configs, tokenizer and sharding are RELEASED's. Needs torch.")
    p.add_argument("trained", help="directory with the trained text tensors (safetensors), or a Hub id")
    p.add_argument("released", help="the released checkpoint the run started from (a directory or a Hub id "
                                    "ORG/NAME[@REVISION])")
    p.add_argument("out", help="new directory to write (must not exist)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from apertus_plugins.hf.merge import merge_text_weights

    out = merge_text_weights(args.trained, args.released, args.out)
    print(f"wrote {out}")
    return 0
