"""Judging a program against a problem's test cases with any sandbox backend; many programs at once.

:func:`judge_program` runs the cases one after the other (by default it stops at the first failure: the
reward is binary, 1 only when every case passes) and returns a :class:`Verdict` with one
:class:`CaseVerdict` per case. :func:`judge_many` judges a batch (the rollouts of a step) on a bounded
thread pool; the backend's own ``max_concurrent`` bounds the sandboxes running at once in the process.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .cases import Problem, TestCase, call_matches, outputs_match
from .runner import CodeRunner, Execution, Limits

__all__ = ["CASE_VERDICTS", "CaseVerdict", "Verdict", "call_program", "extract_program", "judge_many",
           "judge_program"]

#: A case's verdict: ``passed``, ``wrong_answer``, an :data:`~.runner.STATUSES` failure, or ``skipped`` (not
#: run after an earlier failure).
CASE_VERDICTS = ("passed", "wrong_answer", "runtime_error", "timeout", "memory_limit", "output_limit",
                 "file_limit", "sandbox_error", "skipped")

#: languages of a fenced block that count as Python
PYTHON_FENCES = frozenset({"", "python", "py", "python3"})
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)

_HARNESS = (Path(__file__).parent / "call_harness.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class CaseVerdict:
    """One case: its verdict, the seconds it ran, and a short detail (the error's last line, a mismatch)."""

    case: int
    verdict: str
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Verdict:
    """A program's result on a problem: ``passed`` only when every case passed."""

    passed: bool
    cases: list[CaseVerdict]
    backend: str
    compare: str
    source_format: str = ""
    notes: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def score(self) -> float:
        return 1.0 if self.passed else 0.0

    def counts(self) -> dict[str, int]:
        return dict(Counter(c.verdict for c in self.cases))

    def to_dict(self) -> dict[str, Any]:
        """The verdict as plain JSON-able data (what the reward keeps in its extra info)."""
        out = asdict(self)
        out["score"] = self.score
        out["counts"] = self.counts()
        out["cases"] = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()} for c in out["cases"]]
        return out


def extract_program(text: str | None) -> str | None:
    """The program in a response: the last fenced block marked Python (or unmarked), else the whole text.

    A response whose only fenced blocks are marked as another language holds no Python program (``None``);
    so does an empty one.
    """
    if text is None:
        return None
    blocks = _FENCE.findall(text)
    if blocks:
        python = [body for lang, body in blocks if lang.lower() in PYTHON_FENCES]
        return python[-1] if python and python[-1].strip() else None
    return text if text.strip() else None


def call_program(solution: str, fn_name: str) -> str:
    """A self-contained program that calls ``fn_name`` of ``solution`` (see :mod:`.call_harness`)."""
    return f"{_HARNESS}\n\nrun_call({solution!r}, {fn_name!r})\n"


def _detail(run: Execution) -> str:
    tail = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""
    return (run.detail or tail)[-300:]


def _case(runner: CodeRunner, program: str, case: TestCase, index: int, problem: Problem,
          limits: Limits) -> CaseVerdict:
    if case.is_call:
        run = runner.run(call_program(program, problem.fn_name or ""), json.dumps(list(case.args)), limits)
    else:
        run = runner.run(program, case.stdin, limits)
    if run.status != "ok":
        return CaseVerdict(index, run.status, run.seconds, _detail(run))
    if case.is_call:
        try:
            result = json.loads(run.stdout)
        except json.JSONDecodeError:
            return CaseVerdict(index, "wrong_answer", run.seconds, f"no JSON result: {run.stdout[:120]!r}")
        ok = call_matches(result, case.expected)
        shown = json.dumps(result)[:120]
    else:
        ok = outputs_match(run.stdout, case.expected, problem.compare)
        shown = repr(run.stdout[:120])
    if ok:
        return CaseVerdict(index, "passed", run.seconds)
    return CaseVerdict(index, "wrong_answer", run.seconds, f"got {shown}, expected {str(case.expected)[:120]!r}")


def judge_program(runner: CodeRunner, program: str | None, problem: Problem, limits: Limits | None = None,
                  stop_on_failure: bool = True) -> Verdict:
    """Run ``program`` on every case of ``problem`` (``None``: no program, every case fails)."""
    base = limits or getattr(runner, "limits", None) or Limits()
    limits = base.tightened(problem.time_limit, problem.memory_limit_mb)
    verdict = Verdict(False, [], runner.name, problem.compare, problem.source_format, list(problem.notes))
    if program is None:
        verdict.error = "the response holds no Python program"
        verdict.cases = [CaseVerdict(i, "skipped") for i in range(len(problem.cases))]
        return verdict
    failed = False
    for i, case in enumerate(problem.cases):
        if failed and stop_on_failure:
            verdict.cases.append(CaseVerdict(i, "skipped"))
            continue
        result = _case(runner, program, case, i, problem, limits)
        verdict.cases.append(result)
        failed = failed or result.verdict != "passed"
    verdict.passed = not failed
    return verdict


def judge_many(runner: CodeRunner, jobs: Sequence[tuple[str | None, Problem]], limits: Limits | None = None,
               max_workers: int | None = None, stop_on_failure: bool = True) -> list[Verdict]:
    """Judge many ``(program, problem)`` pairs on a pool of ``max_workers`` threads (default: the backend's
    ``max_concurrent``); the verdicts come back in order."""
    if not jobs:
        return []
    workers = max(1, min(len(jobs), int(max_workers or runner.max_concurrent)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge") as pool:
        return list(pool.map(lambda job: judge_program(runner, job[0], job[1], limits, stop_on_failure), jobs))
