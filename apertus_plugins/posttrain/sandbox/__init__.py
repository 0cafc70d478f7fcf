"""The code sandbox: run generated programs isolated from the host and judge them on the datasets' test cases.

* :class:`BubblewrapSandbox` (:mod:`.bubblewrap`): the local backend, Debian's ``bubblewrap`` and
  ``prlimit``; its module docstring says what isolates what, and the limits of it.
* :mod:`.cases`: the ground-truth formats of APPS, TACO, CodeContests and Codeforces, and each source's
  output comparison.
* :mod:`.judge`: a program against a problem's cases (one :class:`CaseVerdict` per case), many at once.
* :class:`CodeRunner` (:mod:`.runner`): the backend interface; verl's SandboxFusion client is another
  backend (:mod:`verl_ext.sandbox_fusion`).

The ``code`` reward (:func:`apertus_plugins.posttrain.rewards.code_reward`) puts these together.
"""

from __future__ import annotations

import threading
from typing import Any

from .bubblewrap import BubblewrapSandbox, default_interpreter
from .cases import Problem, TestCase, compare_mode_for, parse_ground_truth
from .judge import CASE_VERDICTS, CaseVerdict, Verdict, call_program, extract_program, judge_many, judge_program
from .runner import STATUSES, CodeRunner, Execution, Limits, SandboxUnavailable

__all__ = [
    "CASE_VERDICTS",
    "STATUSES",
    "BubblewrapSandbox",
    "CaseVerdict",
    "CodeRunner",
    "Execution",
    "Limits",
    "Problem",
    "SandboxUnavailable",
    "TestCase",
    "Verdict",
    "call_program",
    "compare_mode_for",
    "default_interpreter",
    "extract_program",
    "judge_many",
    "judge_program",
    "local_sandbox",
    "parse_ground_truth",
]

_LOCAL: dict[tuple, BubblewrapSandbox] = {}
_LOCAL_LOCK = threading.Lock()


def local_sandbox(options: dict[str, Any] | None = None) -> BubblewrapSandbox:
    """The process's local sandbox for these options (one per distinct options: its concurrency bound is shared).

    ``options``: ``python``, ``max_concurrent``, ``extra_ro_binds`` and ``limits`` (a mapping of
    :class:`Limits` fields); anything else is an error naming it.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - {"python", "max_concurrent", "extra_ro_binds", "limits"})
    if unknown:
        raise ValueError(f"unknown local sandbox options {unknown}; known: python, max_concurrent, extra_ro_binds, "
                         "limits")
    limits = Limits.from_options(options.get("limits"))
    key = (options.get("python"), options.get("max_concurrent"), tuple(options.get("extra_ro_binds") or ()), limits)
    with _LOCAL_LOCK:
        if key not in _LOCAL:
            _LOCAL[key] = BubblewrapSandbox(python=options.get("python"), limits=limits,
                                            max_concurrent=options.get("max_concurrent"),
                                            extra_ro_binds=tuple(options.get("extra_ro_binds") or ()))
        return _LOCAL[key]
