"""``apertus tokenize pretrain|sft|interleaved|longcontext SOURCE... --out PREFIX``: media, conversations,
interleaved speech-text recordings and the synthetic long-context tasks -> Megatron indexed datasets."""

from __future__ import annotations

import argparse

from apertus_plugins.cli.encode import add_media_cache_args
from apertus_plugins.data.offline.batching import AUDIO_BATCHINGS
from apertus_plugins.data.offline.config import (
    AUDIO_TASKS,
    CAPTIONS,
    IMAGE_LAYOUT_DEFAULT,
    MAX_BAD_FRACTION_DEFAULT,
    MERGES,
    PLAN_BYTES_DEFAULT,
    PLAN_FILES_DEFAULT,
    default_workers,
)

_DESCRIPTION = """\
Tokenize images, audio and conversations offline into Megatron indexed datasets (OUT.bin/OUT.idx,
int32 ids, one sequence per document), with a manifest (OUT.manifest.json) and a summary report
(OUT.report.json). A deterministic plan from file headers groups items by their exact
post-resize shape; planning, encoding and merging run as parallel tasks on local worker processes
or on a Ray cluster (--ray-address: CPU tasks decode ahead of encoder actors that hold the encoders,
one per GPU), each batch writing its own shard and checkpoint; a killed run resumes when the same
command is run again, and the output is byte-identical to an uninterrupted run. Inputs and outputs
may be local paths or URLs of any installed fsspec filesystem (s3://, gs://, hf://...). A bad
item (a truncated or unreadable file, aspect ratio above 200, unsupported samples, anything its
header, decoding, the encoder or its document raises) costs only itself: it is skipped, named
(file, line or tar member, and why) above the progress bar and in the report, and counted by
reason; the rest of its batch is written, and a resumed run does not try it again. A run whose
inputs are mostly broken stops with its report (--max-bad-fraction).

  pretrain: image files/folders, audio files/folders, WebDataset .tar shards; one media item per
            document: BOS + image or audio sequence (+ caption / transcript) + EOS.
  sft:      JSONL conversations (OpenAI or Apertus message shape, media by path); one conversation
            per document, rendered with the training template.
  interleaved: JSONL recordings, one per line: {"clips": [{"audio": PATH, "text": TRANSCRIPT}, ...]}
            in recording order; the report's interleaved speech-text sequences (section 2.2.4), one
            per document (--split-tokens 8192: longer ones to PREFIX.long, the long-context pool).

Audio batching: by default clips share an encoder batch only with clips of identical length
(codes equal single-clip encoding and do not depend on the batch). --audio-batching report
batches as the report's pipeline did (section 2.3.2): duration buckets, batches capped by total
audio duration, clips padded to the longest, the last five codes of a padded clip dropped.

--checkpoint and --tokenizer take a directory or a Hub id ORG/NAME[@REVISION] (the Hugging Face
cache; only the encoder shards of a checkpoint are fetched). --tokenizer defaults to the
checkpoint's own tokenizer. The run ends by printing the image layout it wrote next to the layout
a server uses.
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="input files and folders")
    p.add_argument("--out", required=True, metavar="PREFIX", help="output prefix (PREFIX.bin/.idx and side files)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer directory (tokenizer.json) or Hub id (default: the --checkpoint's own tokenizer)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint with the media encoders (released layout; a directory or a Hub id "
                        "ORG/NAME[@REVISION]); needed when there are media")
    p.add_argument("--image-layout", default=IMAGE_LAYOUT_DEFAULT, choices=("training", "inference"),
                   help=f"image sequence layout (default {IMAGE_LAYOUT_DEFAULT}: the public Megatron pipeline's, what "
                        "Apertus 1.5 was trained on; serving uses inference; the manifest records it)")
    p.add_argument("--resize-policy", default="released", help="image resize policy (default: released)")
    p.add_argument("--audio-policy", default="released", help="audio preprocessing policy (default: released)")
    p.add_argument("--media-limit", action="append", default=[], metavar="NAME=VALUE", type=_media_limit,
                   help="raise or lower one of the core's media limits (repeatable): max_image_pixels "
                        "(default 67108864), reduce_above_pixels (16000000), max_audio_seconds (3600), "
                        "min_sample_rate / max_sample_rate (1000 / 384000), max_channels (64), max_abs_sample "
                        "(16777216); an item above a limit is skipped, named, with its reason")
    p.add_argument("--batch-size", type=int, default=32, help="most items per batch (default 32)")
    p.add_argument("--batch-codes", type=int, default=65536, help="most media codes per batch (default 65536)")
    p.add_argument("--audio-batching", default="exact", choices=AUDIO_BATCHINGS,
                   help="exact (default): clips batched only by identical length, every code kept; report: duration "
                        "buckets, clips padded to the longest of their batch, the last five codes of a padded clip "
                        "dropped (report 2.3.2)")
    p.add_argument("--audio-batch-seconds", type=float, default=1500.0, metavar="S",
                   help="report batching: most seconds of audio per batch (default 1500)")
    p.add_argument("--audio-buckets", type=int, default=20, metavar="N",
                   help="report batching: duration buckets (default 20)")
    p.add_argument("--workers", type=int, default=default_workers(),
                   help=f"local worker processes (default {default_workers()}; 0: in this process)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="run on this Ray cluster ('auto', 'host:port', 'ray://host:port', 'local'); the work folder "
                        "and the outputs must be reachable from every node (a shared filesystem or an fsspec URL)")
    p.add_argument("--encoders", type=int, default=0, metavar="N",
                   help="encoder actors on Ray (default 0: one per GPU, or one per two CPUs without GPUs)")
    p.add_argument("--device", default="auto",
                   help="encoder device: auto (default: CUDA when the machine or the Ray cluster has a GPU), cpu, "
                        "cuda, cuda:N")
    p.add_argument("--precision", default="float32", choices=("float32", "tf32"),
                   help="encoder precision contract (tf32: CUDA only)")
    p.add_argument("--merge", default="single", choices=MERGES,
                   help="single (default): one dataset PREFIX.bin/.idx per stream; parts: one dataset per plan part "
                        "(PREFIX.partNNNNNN), merged in parallel and listed in order in the manifest, with no pass "
                        "over all the data on one node")
    p.add_argument("--plan-files", type=int, default=PLAN_FILES_DEFAULT, metavar="N",
                   help=f"files of a folder per planning shard (default {PLAN_FILES_DEFAULT}; a .tar is one shard)")
    p.add_argument("--plan-bytes", type=_size, default=PLAN_BYTES_DEFAULT, metavar="SIZE",
                   help=f"bytes of a JSONL file per planning shard (default {PLAN_BYTES_DEFAULT // 2**20}MB)")
    p.add_argument("--work-dir", metavar="DIR", help="plan, shards and checkpoints (default PREFIX.work)")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory after success")
    p.add_argument("--plan-only", action="store_true",
                   help="stop after planning (the work directory keeps the plan; the same command without "
                        "--plan-only continues from it)")
    p.add_argument("--restart", action="store_true", help="discard an earlier run's work and outputs")
    p.add_argument("--max-bad-fraction", type=_fraction, default=MAX_BAD_FRACTION_DEFAULT, metavar="F",
                   help=f"stop the run, with its report, once more than this share of the input items is skipped "
                        f"(certainly, or projected from the first 1,000 items encoded); default "
                        f"{MAX_BAD_FRACTION_DEFAULT:g}, 1 never stops; a stopped run continues with a higher value")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_media_cache_args(p)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a share between 0 and 1 (0.5: half the items)")
    return value


def _size(text: str) -> int:
    from apertus_plugins.infra.sizes import parse_size

    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not n or n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size of at least one byte (examples: 4KB, 64MB)")
    return n


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
    inter = kinds.add_parser("interleaved", help="JSONL recordings: the report's interleaved speech-text sequences",
                             description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(inter)
    inter.add_argument("--split-tokens", type=int, default=0, metavar="N",
                       help="write sequences longer than N tokens to PREFIX.long (the report: 8192 between stage 2 "
                            "and the long-context extension; default 0: no cut)")
    inter.add_argument("--media-root", metavar="DIR",
                       help="relative clip paths are resolved here (default: the JSONL file's folder)")
    inter.add_argument("--no-bos", action="store_true", help="documents do not start with BOS")
    inter.add_argument("--no-eos", action="store_true", help="documents do not end with EOS")
    inter.set_defaults(func=run)
    _add_longcontext(kinds)


_LONGCONTEXT = """\
Generate the synthetic long-context tasks of the report (section 3.3, Appendix F; Table 8 for
long-context SFT) from the texts of JSONL files: common-word extraction (CWE), document-order
reconstruction (DocOrder) and artificial needles, each example one tokenized conversation whose
loss mask trains the answers only. Source documents of a quarter to half the target length make
hard examples (10 CWE questions, 8 DocOrder sections), longer ones easy examples (5 questions, 4
sections); needles take lengths from a quarter of the target to the target. Empty, too short, too
long or unreadable documents are skipped, named and counted. The tasks' token shares follow the
report's mix for --model and --step (or --mix). Streams: one example in memory at a time.

Writes PREFIX.bin/.idx (name it in --apertus-sft-data of the long-context recipes), the mask
stream PREFIX.mask.bin/.idx (--apertus-sft-mask stored), PREFIX.examples.jsonl (each example's
task, bucket, source and answers), PREFIX.report.json and PREFIX.manifest.json.
"""


def _add_longcontext(kinds: argparse._SubParsersAction) -> None:
    from apertus_plugins.core.longcontext import STEPS

    lc = kinds.add_parser("longcontext", help="synthetic long-context tasks (CWE, DocOrder, needles) from JSONL texts",
                          description=_LONGCONTEXT, formatter_class=argparse.RawDescriptionHelpFormatter)
    lc.add_argument("sources", nargs="*", metavar="JSONL", help="JSONL files of source documents (none: needles only)")
    lc.add_argument("--out", required=True, metavar="PREFIX", help="output prefix")
    lc.add_argument("--tokenizer", required=True, metavar="DIR", help="tokenizer directory or Hub id")
    lc.add_argument("--step", default="32k", choices=tuple(STEPS),
                    help="the long-context step (32k, 64k, 128k, 256k: the extension; sft: long-context SFT); sets "
                         "the target length and the report's task mix (default 32k)")
    lc.add_argument("--model", default="8b", choices=("8b", "70b"), help="whose mix (Tables F.1/F.2, 8; default 8b)")
    lc.add_argument("--length", type=int, metavar="TOKENS", help="target length (default: the step's)")
    lc.add_argument("--mix", type=_mix, metavar="cwe=W,docorder=W,needles=W",
                    help="token shares of the tasks instead of the report's")
    lc.add_argument("--seed", type=int, default=0, help="seed of every draw (default 0)")
    lc.add_argument("--text-key", default="text", help="the key of a record's text (default text)")
    lc.add_argument("--max-tokens", type=int, metavar="N", help="stop after N tokens (default: the documents' end)")
    lc.add_argument("--max-examples", type=int, metavar="N", help="stop after N examples")
    lc.set_defaults(func=run_longcontext)


def _mix(text: str) -> dict[str, float]:
    from apertus_plugins.core.longcontext import TASKS

    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or name.strip() not in TASKS or weight < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=WEIGHT,... with NAME one of {', '.join(TASKS)} "
                                             "and WEIGHT a non-negative number")
        out[name.strip()] = weight
    return out


def run_longcontext(args: argparse.Namespace) -> int:
    import json

    from apertus_plugins.core.chat import ChatTokenizer
    from apertus_plugins.core.longcontext import STEPS, report_mix
    from apertus_plugins.data.longcontext import write_long_context
    from apertus_plugins.infra.hub import local_path

    tokenizer = local_path(args.tokenizer, weights=False, what="--tokenizer")
    mix = args.mix if args.mix is not None else report_mix(args.model, args.step)
    length = args.length if args.length is not None else STEPS[args.step]
    describe = {"step": args.step, "model": args.model, "mix_from": "--mix" if args.mix else "report"}
    report = write_long_context(args.sources, args.out, ChatTokenizer(tokenizer), length=length, mix=mix,
                                seed=args.seed, max_tokens=args.max_tokens, max_examples=args.max_examples,
                                text_key=args.text_key, describe=describe)
    summary = {k: report[k] for k in ("examples", "buckets", "tokens", "shares", "skipped", "shortest", "longest")}
    print(json.dumps(summary, indent=2))
    return 0


def resolve_inputs(tokenizer: str | None, checkpoint: str | None) -> tuple[str, str | None]:
    """Local directories for ``--tokenizer`` and ``--checkpoint`` (Hub ids resolved; the tokenizer
    defaults to the checkpoint's own)."""
    from apertus_plugins.core.tensor_names import AUDIO_PREFIX, VISION_PREFIX
    from apertus_plugins.infra.hub import local_path

    if tokenizer is None and checkpoint is None:
        raise ValueError("give --tokenizer (a tokenizer directory or Hub id), or --checkpoint to use its tokenizer")
    ckpt = str(local_path(checkpoint, weights=(VISION_PREFIX, AUDIO_PREFIX), what="--checkpoint")) \
        if checkpoint is not None else None
    tok = str(local_path(tokenizer, weights=False, what="--tokenizer")) if tokenizer is not None else ckpt
    return tok, ckpt  # type: ignore[return-value]


def layout_line(report: dict) -> str:
    """The image layout a run wrote next to the one a server uses (the last line ``tokenize`` prints)."""
    from apertus_plugins.plugins import serving_layout

    written, serving = report["image_layout"], serving_layout("image")
    images = int(report.get("media", {}).get("image", 0))
    where = f"{images:,} image{'s' if images != 1 else ''}" if images else "no images in this run"
    verdict = "the same" if written == serving else "they differ: train/serve skew, recorded in the manifest"
    return f"image layout: {written} (written, {where}) | {serving} (serving) -- {verdict}"


def _media_limit(text: str) -> tuple[str, float]:
    """``NAME=VALUE`` of ``--media-limit``: a field of the core's ``MediaLimits`` and a number."""
    from apertus_plugins.core.media.limits import MediaLimits

    name, sep, value = text.partition("=")
    if not sep or name not in MediaLimits.names():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE with NAME one of {', '.join(MediaLimits.names())}")
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None
    return name, int(number) if number.is_integer() and name != "max_audio_seconds" else number


def run(args: argparse.Namespace) -> int:
    from apertus_plugins.data.offline import TokenizeConfig, tokenize

    tokenizer, checkpoint = resolve_inputs(args.tokenizer, args.checkpoint)
    common = dict(
        kind=args.kind, sources=args.sources, out=args.out, tokenizer=tokenizer, checkpoint=checkpoint,
        work_dir=args.work_dir, image_layout=args.image_layout, resize_policy=args.resize_policy,
        audio_policy=args.audio_policy, media_limits=dict(args.media_limit), batch_size=args.batch_size, batch_codes=args.batch_codes,
        precision=args.precision, workers=args.workers, ray_address=args.ray_address, device=args.device,
        progress=not args.no_progress, keep_work=args.keep_work, restart=args.restart, merge=args.merge,
        plan_files=args.plan_files, plan_bytes=args.plan_bytes, encoders=args.encoders, plan_only=args.plan_only,
        max_bad_fraction=args.max_bad_fraction, media_cache=args.media_cache, media_cache_size=args.media_cache_size,
        audio_batching=args.audio_batching, audio_batch_seconds=args.audio_batch_seconds,
        audio_buckets=args.audio_buckets,
    )
    if args.kind == "pretrain":
        cfg = TokenizeConfig(**common, audio_task=args.audio_task, captions=args.captions, window=args.window,
                             bos=not args.no_bos, eos=not args.no_eos)
    elif args.kind == "interleaved":
        cfg = TokenizeConfig(**common, split_tokens=args.split_tokens, media_root=args.media_root,
                             bos=not args.no_bos, eos=not args.no_eos)
    else:
        cfg = TokenizeConfig(**common, without_reasoning=args.without_reasoning, mask_stream=args.mask_stream,
                             media_root=args.media_root)
    report = tokenize(cfg)
    if not cfg.plan_only:  # a plan summary (printed by tokenize) has no layout written yet
        print(layout_line(report))
    return 0
