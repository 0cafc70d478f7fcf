"""``apertus tokenize pretrain|sft SOURCE... --out PREFIX``: media and conversations -> Megatron indexed datasets."""

from __future__ import annotations

import argparse

from ..offline.config import AUDIO_TASKS, CAPTIONS, IMAGE_LAYOUT_DEFAULT, default_workers

_DESCRIPTION = """\
Tokenize images, audio and conversations offline into Megatron indexed datasets (OUT.bin/OUT.idx,
int32 ids, one sequence per document), with a manifest (OUT.manifest.json) and a summary report
(OUT.report.json). A deterministic plan from file headers groups items by their exact
post-resize shape; batches run on local worker processes or as Ray tasks (--ray-address), each
writing its own shard and checkpoint; a killed run resumes when the same command is run again, and
the merged output is byte-identical to an uninterrupted run. Bad inputs (truncated or unreadable
files, aspect ratio above 200, unsupported samples) are skipped, counted and named in the report.

  pretrain: image files/folders, audio files/folders, WebDataset .tar shards; one media item per
            document: BOS + image or audio sequence (+ caption / transcript) + EOS.
  sft:      JSONL conversations (OpenAI or Apertus message shape, media by path); one conversation
            per document, rendered with the training template.
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="input files and folders")
    p.add_argument("--out", required=True, metavar="PREFIX", help="output prefix (PREFIX.bin/.idx and side files)")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="tokenizer directory (tokenizer.json)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint with the media encoders (released layout); needed when there are media")
    p.add_argument("--image-layout", default=IMAGE_LAYOUT_DEFAULT, choices=("training", "inference"),
                   help=f"image sequence layout (default {IMAGE_LAYOUT_DEFAULT}: the public Megatron pipeline's, what "
                        "Apertus 1.5 was trained on; serving uses inference; the manifest records it)")
    p.add_argument("--resize-policy", default="released", help="image resize policy (default: released)")
    p.add_argument("--audio-policy", default="released", help="audio preprocessing policy (default: released)")
    p.add_argument("--batch-size", type=int, default=32, help="most items per batch (default 32)")
    p.add_argument("--batch-codes", type=int, default=65536, help="most media codes per batch (default 65536)")
    p.add_argument("--workers", type=int, default=default_workers(),
                   help=f"local worker processes (default {default_workers()}; 0: in this process)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="run the batches as Ray tasks on this cluster ('auto', 'ray://host:port', 'local'); the "
                        "output folder must be on a filesystem every node shares")
    p.add_argument("--device", default="cpu", help="encoder device (cpu, cuda, cuda:N)")
    p.add_argument("--precision", default="float32", choices=("float32", "tf32"),
                   help="encoder precision contract (tf32: CUDA only)")
    p.add_argument("--work-dir", metavar="DIR", help="plan, shards and checkpoints (default PREFIX.work)")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory after success")
    p.add_argument("--restart", action="store_true", help="discard an earlier run's work and outputs")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="tokenize media and conversations into Megatron indexed datasets",
                       description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    pre = kinds.add_parser("pretrain", help="images, audio, WebDataset shards: one media item per document",
                           description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(pre)
    pre.add_argument("--audio-task", default="auto", choices=AUDIO_TASKS,
                     help="audio documents: auto (transcribe when a transcript exists, else audio only), audio, "
                          "transcribe, translate, annotate")
    pre.add_argument("--captions", default="after", choices=CAPTIONS, help="where an image's caption goes")
    pre.add_argument("--window", type=int, default=4096,
                     help="consecutive items grouped by shape together (default 4096)")
    pre.add_argument("--no-bos", action="store_true", help="documents do not start with BOS")
    pre.add_argument("--no-eos", action="store_true", help="documents do not end with EOS")
    pre.set_defaults(func=run)
    sft = kinds.add_parser("sft", help="JSONL conversations: one conversation per document",
                           description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(sft)
    sft.add_argument("--without-reasoning", action="store_true",
                     help="also write PREFIX.noreason with the reasoning spans removed")
    sft.add_argument("--mask-stream", action="store_true",
                     help="also write the token-aligned loss mask as PREFIX.mask (uint8)")
    sft.add_argument("--media-root", metavar="DIR",
                     help="relative media paths are resolved here (default: the JSONL file's folder)")
    sft.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..offline import TokenizeConfig, tokenize

    common = dict(
        kind=args.kind, sources=args.sources, out=args.out, tokenizer=args.tokenizer, checkpoint=args.checkpoint,
        work_dir=args.work_dir, image_layout=args.image_layout, resize_policy=args.resize_policy,
        audio_policy=args.audio_policy, batch_size=args.batch_size, batch_codes=args.batch_codes,
        precision=args.precision, workers=args.workers, ray_address=args.ray_address, device=args.device,
        progress=not args.no_progress, keep_work=args.keep_work, restart=args.restart,
    )
    if args.kind == "pretrain":
        cfg = TokenizeConfig(**common, audio_task=args.audio_task, captions=args.captions, window=args.window,
                             bos=not args.no_bos, eos=not args.no_eos)
    else:
        cfg = TokenizeConfig(**common, without_reasoning=args.without_reasoning, mask_stream=args.mask_stream,
                             media_root=args.media_root)
    tokenize(cfg)
    return 0
