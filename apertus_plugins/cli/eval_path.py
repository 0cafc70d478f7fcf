"""``apertus eval-path lm_eval|lmms_eval``: print the folder to give the harness as ``--include_path``.

    lm-eval   --tasks apertus_gsm8k_chat --include_path "$(apertus eval-path lm_eval)" ...
    lmms-eval --tasks apertus_chartqa    --include_path "$(apertus eval-path lmms_eval)" ...

The folders live in the ``eval_tasks`` package; this command only locates them (it imports
neither harness).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

HARNESSES = ("lm_eval", "lmms_eval")


def include_path(harness: str) -> Path:
    """The task folder of ``harness`` (``lm_eval`` or ``lmms_eval``) inside the ``eval_tasks`` package."""
    name = harness.replace("-", "_")
    if name not in HARNESSES:
        raise ValueError(f"unknown harness {harness!r}; expected one of {', '.join(HARNESSES)}")
    spec = importlib.util.find_spec("eval_tasks")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the eval_tasks package is not installed alongside apertus_plugins")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_dir():
        raise ValueError(f"task folder {path} is missing from the eval_tasks package")
    return path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-path", help="print the task folder to pass to lm-eval/lmms-eval --include_path",
                       description="Print the folder holding the Apertus 1.5 task definitions for one harness; "
                                   "pass it as --include_path.")
    p.add_argument("harness", choices=[*HARNESSES, "lm-eval", "lmms-eval"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(include_path(args.harness))
    return 0
