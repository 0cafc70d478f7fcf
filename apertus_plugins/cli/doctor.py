"""``apertus doctor``: the release compatibility checks of a checkpoint, as a table or JSON."""

from __future__ import annotations

import argparse
import sys

from apertus_plugins.infra.release_ids import MODEL_8B, TOKENIZER_REPO


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="release checks of a checkpoint: tokenizer, template, config, layout, stages, serving",
        description="Run the release compatibility checks on CHECKPOINT and print one line of evidence per "
                    "check. Exits 1 when a check fails (with --strict also on a warning), 2 on bad input.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help=f"the checkpoint directory, or a Hub id ORG/NAME[@REVISION] such as {MODEL_8B} (read from "
                        "the Hugging Face cache)")
    p.add_argument("--serve", metavar="URL", help="a server of CHECKPOINT (http://host:port): adds the serve checks")
    p.add_argument("--model", help="the served model name (default: the server's first)")
    p.add_argument("--compare", metavar="OTHER_CHECKPOINT",
                   help="another stage's checkpoint (a directory or a Hub id): tokenizer files, templates and RoPE "
                        "scaling must be identical")
    p.add_argument("--dataset", action="append", default=[], metavar="PATH",
                   help="a dataset manifest or indexed prefix whose image layout is checked against serving "
                        "(repeatable)")
    p.add_argument("--checksums", metavar="MANIFEST",
                   help=f"a checksum manifest of the tokenizer repository (validation/Apertus_1p5.md5 of "
                        f"{TOKENIZER_REPO}, md5sum's format): the files it names must match")
    p.add_argument("--only", metavar="NAMES", help="comma-separated groups or check ids to run")
    p.add_argument("--probe-prompts", metavar="FILE",
                   help="the degeneration probe's prompts (JSON list or lines of {\"prompt\": ...} or "
                        "{\"messages\": [...]}, optionally with \"request\": {extra request fields})")
    p.add_argument("--probe-tokens", type=int, default=256, help="max_tokens of each probe generation (256)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per server request (300)")
    p.add_argument("--api-key", default=None,
                   help="the server's API key (vllm serve --api-key; default: $OPENAI_API_KEY when set)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 on a warning too")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from apertus_plugins.doctor import DoctorError, load_probe_prompts, run_doctor

    def progress(result) -> None:  # noqa: ANN001 - a Result
        if not args.json:
            print(f"  {result.status:4s}  {result.id}", file=sys.stderr, flush=True)

    try:
        probes = load_probe_prompts(args.probe_prompts) if args.probe_prompts else None
        report = run_doctor(args.checkpoint, serve=args.serve, model=args.model, compare=args.compare,
                            datasets=args.dataset, only=args.only.split(",") if args.only else None,
                            probe_prompts=probes, probe_tokens=args.probe_tokens, timeout=args.timeout,
                            api_key=args.api_key, checksums=args.checksums,
                            progress=progress if sys.stderr.isatty() else None)
    except DoctorError as exc:
        print(f"apertus doctor: error: {exc}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else report.table())
    return report.exit_code(strict=args.strict)
