"""``apertus convert to-megatron|to-hf SRC OUT``: checkpoints between the released layout and Megatron's.

* ``to-megatron HF_DIR OUT``: a released ``transformers`` checkpoint (Apertus 1.5, or Apertus 1.0
  with ``--extend-vocab``) -> a Megatron ``torch_dist`` checkpoint; prints the Megatron flags of the
  model. The RoPE scaling goes into the checkpoint's arguments (an unrepresentable one is an error).
* ``to-hf MEGATRON_DIR OUT``: back, the head pruned to the text rows; the vision and audio
  tokenizers, the configuration and the side files come from ``MEGATRON_DIR/apertus/`` (written by
  ``to-megatron``) or from ``--reference`` (a released checkpoint directory, or such a converted
  Megatron directory). The RoPE settings come from the Megatron checkpoint's own arguments.

Needs torch, safetensors and megatron-core (``pip install 'apertus-plugins[megatron]'``). The
command joins ``apertus`` through the core's plugin hooks (:mod:`megatron_patches.apertus_plugin`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from apertus_plugins.core.release import ROPE_TYPE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert checkpoints between the released transformers layout and Megatron's",
        description="Convert Apertus checkpoints between the released transformers layout and Megatron's "
        "distributed (torch_dist) layout, keeping the RoPE scaling, the vision/audio tokenizers and the "
        "side files; --extend-vocab grows an Apertus 1.0 vocabulary to 1.5's.",
    )
    p.add_argument("direction", choices=("to-megatron", "to-hf"))
    p.add_argument("source", help="to-megatron: a transformers checkpoint directory; to-hf: a Megatron --save "
                   "directory (or one iteration directory)")
    p.add_argument("out", help="output directory (replaced at the end, never left half-written)")
    p.add_argument("--extend-vocab", type=int, default=None, metavar="ROWS",
                   help="to-megatron: grow the embedding and head to ROWS rows (1.0 -> 1.5: 266752), new rows at a "
                   "tenth of the mean norm of the existing ones")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="to-hf: where the configuration, the vision/audio tokenizers and the side files come from")
    p.add_argument("--output-vocab-size", type=int, default=None, metavar="N",
                   help="to-hf: rows of the released LM head (default: the reference config's output_vocab_size)")
    p.add_argument("--seed", type=int, default=1234, help="seed of new embedding/head rows (default 1234)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="to-hf: safetensors shard size (default 5)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _reference(path: Path) -> tuple[dict, dict, dict]:
    """(config, passthrough tensors, side files) from a converted Megatron directory or a released checkpoint."""
    from safetensors.torch import load_file

    from apertus_plugins.infra.hub import local_path

    from .convert import PASSTHROUGH_PREFIXES, ConversionError, read_hf_checkpoint

    path = local_path(path, weights=True, what="--reference")  # a directory, or a Hub id ORG/NAME[@REVISION]
    side_dir = path / "apertus"
    if (side_dir / "config.json").is_file():
        files = {f.name: f.read_bytes() for f in sorted((side_dir / "files").glob("*")) if f.is_file()}
        return (json.loads((side_dir / "config.json").read_text()),
                load_file(str(side_dir / "passthrough.safetensors")), files)
    if (path / "config.json").is_file():
        tensors, config, files = read_hf_checkpoint(path)
        keep = {k: v for k, v in tensors.items() if k.startswith(PASSTHROUGH_PREFIXES) or k.endswith(
            (".mlp.act_fn.beta", ".mlp.act_fn.eps"))}
        return config, keep, files
    raise ConversionError(f"{path}: neither a converted Megatron directory (apertus/config.json) nor a released "
                          "checkpoint (config.json); pass --reference with the released checkpoint")


def run(args: argparse.Namespace) -> int:
    from .convert import (
        ConversionError,
        ModelShape,
        hf_config_from_shape,
        hf_to_megatron,
        megatron_to_hf,
        read_hf_checkpoint,
        write_hf_checkpoint,
    )

    try:
        from .checkpoint import load_megatron, save_megatron
    except ImportError as exc:
        raise ConversionError(f"apertus convert needs torch and megatron-core ({exc})") from exc
    src, out = Path(args.source), Path(args.out)
    if args.direction == "to-megatron":
        tensors, config, side = read_hf_checkpoint(src, progress=not args.no_progress)
        shape = ModelShape.from_hf_config(config)
        converted = hf_to_megatron(tensors, shape, embedding_rows=args.extend_vocab, seed=args.seed)
        save_megatron(converted, out, hf_config=config, side_files=side)
        print(f"wrote {out}: {shape.num_layers} layers, embedding {converted.shape.embedding_rows} rows, "
              f"{len(converted.passthrough)} tensors passed through")
        print("Megatron flags of this model (with apertus-megatron; load with --load DIR --finetune):")
        print("  " + " ".join(converted.shape.megatron_flags()))
        return 0
    ref = Path(args.reference) if args.reference else src
    config, passthrough, side = _reference(ref)
    text = config.get("text_config", config)
    head = args.output_vocab_size or text.get("output_vocab_size") or text.get("vocab_size")
    tensors, margs = load_megatron(src)
    shape = ModelShape.from_megatron_args(margs, head_rows=head)
    hf = megatron_to_hf(tensors, shape, passthrough)
    write_hf_checkpoint(out, hf, hf_config_from_shape(shape, config), side,
                        max_shard_bytes=int(args.max_shard_gb * (1 << 30)), progress=not args.no_progress)
    rope = shape.rope
    print(f"wrote {out}: {shape.num_layers} layers, head {shape.head_rows} rows, RoPE {rope.rope_type} "
          f"theta {rope.theta:g}" + (f" factor {rope.factor:g}" if rope.rope_type == ROPE_TYPE else ""))
    return 0
