"""The evaluation adapter's ``apertus`` subcommands (added through the core's ``apertus_commands`` hook):

    apertus eval-path lm_eval|lmms_eval          # the task folder to pass as --include_path
    apertus eval report --suite SUITE --base-url URL [--limit N] [--output DIR] ...
    apertus eval benchmarks [--markdown]         # every benchmark of the report and its Apertus task

Neither harness is imported to build the parser: ``apertus --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HARNESSES = ("lm_eval", "lmms_eval", "lm-eval", "lmms-eval")


def add_eval_path(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-path", help="print the task folder to pass to lm-eval/lmms-eval --include_path",
                       description="Print the folder holding the Apertus 1.5 tasks for one harness (generated from the "
                                   "installed harness's own task configs on first use, then reused); pass it as "
                                   "--include_path.")
    p.add_argument("harness", choices=HARNESSES)
    p.set_defaults(func=_eval_path)


def _eval_path(args: argparse.Namespace) -> int:
    from .derive import include_path

    try:
        print(include_path(args.harness.replace("-", "_")))
    except ImportError as exc:
        print(f"apertus eval-path: {exc}", file=sys.stderr)
        return 1
    return 0


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return values


def add_eval(sub: argparse._SubParsersAction) -> None:
    from .catalogue import SUITES

    p = sub.add_parser("eval", help="the report's evaluation: run a suite against a served model, list the benchmarks",
                       description="The Apertus 1.5 report's evaluation tables, reproduced through lm-eval and "
                                   "lmms-eval against a served model.")
    evsub = p.add_subparsers(dest="eval_command", metavar="ACTION")
    r = evsub.add_parser("report", help="run a suite and write its tables beside the report's numbers",
                         description="Run a suite of the report's benchmarks against a served Apertus model (vLLM with "
                                     "this plugin), through lm-eval and lmms-eval, and write report.md (our numbers "
                                     "beside the report's for the released 8B), report.svg and report.json. Finished "
                                     "tasks are kept: the same command again resumes a killed run.",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="suites:\n" + "\n".join(f"  {k:18} {v}" for k, v in SUITES.items()))
    r.add_argument("--suite", required=True, choices=list(SUITES))
    r.add_argument("--base-url", required=True, help="the server's /v1 URL, e.g. http://127.0.0.1:8000/v1")
    r.add_argument("--model", default=None, help="the served model name (default: the server's first)")
    r.add_argument("--output", type=Path, default=Path("apertus-eval"), help="the run's folder (default ./apertus-eval)")
    r.add_argument("--limit", type=int, default=None, help="items per task (a check of the wiring, not of the model)")
    r.add_argument("--benchmarks", default="", help="comma-separated benchmark ids of the suite to run "
                   "(apertus eval benchmarks lists them)")
    r.add_argument("--tokenizer", default=None, help="the model's tokenizer (checkpoint folder or Hub id): "
                   "log-likelihood tasks and RULER need it")
    r.add_argument("--lengths", type=_ints, default=None, help="RULER's lengths in tokens (default: the report's, "
                   "8192 to 262144)")
    r.add_argument("--max-new-tokens", type=int, default=None, help="lower every output budget to N (against a "
                   "server with a short context; then the numbers are not the protocol's)")
    r.add_argument("--num-concurrent", type=int, default=1, help="requests in flight per task")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    r.add_argument("--allow-code-execution", action="store_true", help="run the coding tasks, which execute the "
                   "model's code")
    r.add_argument("--skip-unmet", action="store_true", help="run the tasks whose needs are met, list the others")
    r.add_argument("--rerun", action="store_true", help="run finished tasks again (default: keep them)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_report)
    b = evsub.add_parser("benchmarks", help="every benchmark of the report: its Apertus task, or why it has none")
    b.add_argument("--markdown", action="store_true", help="the documentation's table")
    b.set_defaults(func=_benchmarks)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _report(args: argparse.Namespace) -> int:
    from eval_tasks.report.runner import DEFAULT_LENGTHS, Options, ReportError, run

    opts = Options(suite=args.suite, base_url=args.base_url.rstrip("/"), output=args.output, model=args.model,
                   limit=args.limit, tokenizer=args.tokenizer, lengths=args.lengths or DEFAULT_LENGTHS,
                   max_new_tokens=args.max_new_tokens, num_concurrent=args.num_concurrent, timeout=args.timeout,
                   allow_code_execution=args.allow_code_execution, skip_unmet=args.skip_unmet, rerun=args.rerun,
                   progress=not args.no_progress)
    only = tuple(x.strip() for x in args.benchmarks.split(",") if x.strip())
    try:
        report = run(opts, only)
    except (ReportError, ImportError) as exc:
        print(f"apertus eval report: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0


def _benchmarks(args: argparse.Namespace) -> int:
    from eval_tasks.report.render import benchmark_table

    from .catalogue import load

    if args.markdown:
        print(benchmark_table(), end="")
        return 0
    for b in load():
        what = ", ".join(b.tasks.values()) if b.runnable else f"absent: {b.absent}"
        print(f"{b.id:26} {b.name:34} {what}")
    return 0
