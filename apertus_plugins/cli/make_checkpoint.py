"""``apertus make-checkpoint DIR``: a small random checkpoint in the released Apertus 1.5 layout."""

from __future__ import annotations

import argparse

from apertus_plugins.cli._layout import add_layout_args, layout_spec
from apertus_plugins.core.release import CONTEXT_LENGTH
from apertus_plugins.testing.checkpoint import INITS, SIZES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-checkpoint", help="write a small random checkpoint in the released layout",
        description="Write an Apertus1p5ForConditionalGeneration directory with random weights: config.json in the "
                    "port's shape, safetensors with the released tensor names (language model, vision and audio "
                    "tokenizers, pruned LM head), the tokenizer with the chat templates, generation_config.json "
                    "(stops </s>, <|assistant_end|>, <|tools_suffix|>) and the processor config. Scaled-down "
                    "vocabulary by default; --full writes the released 266,752-row layout. Needs torch.")
    p.add_argument("dir", help="directory to create")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny",
                   help="language model size (tiny: hidden 128, 2 layers, 2 heads of 64, MLP 256)")
    add_layout_args(p, full_help="the released vocabulary layout (266,752 embedding rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="language model dtype (the encoders are always float32)")
    p.add_argument("--init", choices=INITS, default="standard",
                   help="language model weights: standard (a training initialization, nearly flat outputs) or "
                        "varied (every tensor shapes the output; for numerical comparisons between implementations)")
    p.add_argument("--shard-size", default=None, help="largest safetensors shard, e.g. 50MB (default: one file)")
    p.add_argument("--max-position-embeddings", type=int, default=CONTEXT_LENGTH)
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from apertus_plugins.testing.checkpoint import write_checkpoint

    spec = layout_spec(args)
    out = write_checkpoint(args.dir, size=args.size, spec=spec, seed=args.seed, dtype=args.dtype,
                           shard_size=args.shard_size, max_position_embeddings=args.max_position_embeddings,
                           overwrite=args.overwrite, init=args.init)
    print(f"wrote {out} ({args.size}, {spec.embedding_rows} embedding rows, {args.dtype} language model, "
          f"{args.init} init, seed {args.seed})")
    return 0
