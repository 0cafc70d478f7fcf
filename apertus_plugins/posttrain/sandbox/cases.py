"""Test cases of the report's code sources, as the datasets ship them, and how each source compares outputs.

Ground truth formats read by :func:`parse_ground_truth` (a mapping, or its JSON text):

* **APPS / TACO** (and verl's own code datasets): ``{"inputs": [...], "outputs": [...]}``; with
  ``"fn_name"`` the cases are function calls, otherwise standard input / output. The raw dataset rows'
  ``{"input_output": "<that JSON>"}`` is read too. A call case's input is a list of arguments (APPS,
  TACO) or JSON lines, one argument a line (verl's prime_code layout); its output is the return value,
  or a one-element list holding it, or its JSON.
* **CodeContests** (``deepmind/code_contests``): ``{"public_tests": {"input": [...], "output": [...]},
  "private_tests": {...}, "generated_tests": {...}}`` (all present groups, in that order) or one
  ``{"input": [...], "output": [...]}`` group.
* **Codeforces** (``open-r1/codeforces``): ``{"official_tests": [{"input": str, "output": str}, ...]}``
  (``generated_tests`` appended when present), or a bare list of such cases, with the problem's
  ``time_limit`` (seconds) and ``memory_limit`` (MB) when given.

Output comparison (``compare``):

* ``lines`` (APPS and TACO, as their ``testing_util`` judges and verl's ``prime_code`` ships it): the output
  matches when, after trimming each line and dropping blank lines, the lines are equal; or, when both sides
  are lists of numbers of equal length, not all integers, when they are close (``numpy.allclose``
  defaults: relative 1e-5, absolute 1e-8). testing_util's last fallback (the same tokens in any order)
  is not taken: it accepts permuted, wrong answers.
* ``tokens`` (CodeContests and Codeforces, as the CodeContests execution tester judges): the outputs split
  on whitespace, compared case-insensitively token by token; two numeric tokens of which one is not an
  integer match within an absolute 1e-5.
* call cases (APPS, TACO): the returned value, tuples read as lists, equals the expected value or the
  single element of a one-element expected list (testing_util's rule).

Which comparison a source gets: the ground truth's ``"compare"``, else :func:`compare_mode_for` of the
data source (``codecontests``/``code_contests``/``codeforces`` in the name: ``tokens``; otherwise ``lines``).
Problems that need a special checker (a ``generated_checker``/``checker`` field: several right answers) are
compared the same way, and :attr:`Problem.checker_ignored` says so (the verdict reports it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CompareMode",
    "Problem",
    "TestCase",
    "call_matches",
    "compare_mode_for",
    "lines_match",
    "parse_ground_truth",
    "tokens_match",
]

CompareMode = str  # "lines" | "tokens"
MODES = ("lines", "tokens")
#: test groups of the CodeContests and Codeforces layouts
GROUPS = ("public_tests", "private_tests", "generated_tests", "official_tests")


@dataclass(frozen=True)
class TestCase:
    """One case: ``stdin`` text and the expected ``stdout`` text, or (``args``, ``expected``) of a call."""

    stdin: str = ""
    expected: Any = ""
    args: tuple[Any, ...] | None = None

    @property
    def is_call(self) -> bool:
        return self.args is not None


@dataclass(frozen=True)
class Problem:
    """A problem's cases, how its outputs compare, and its own limits (``None``: the sandbox defaults)."""

    cases: tuple[TestCase, ...]
    compare: CompareMode = "lines"
    fn_name: str | None = None
    time_limit: float | None = None
    memory_limit_mb: int | None = None
    checker_ignored: bool = False
    source_format: str = "apps"
    notes: tuple[str, ...] = field(default_factory=tuple)


def compare_mode_for(data_source: str | None) -> CompareMode:
    """``tokens`` for CodeContests and Codeforces data sources, ``lines`` otherwise (APPS, TACO, others)."""
    name = (data_source or "").lower().replace("-", "_")
    return "tokens" if any(k in name for k in ("codecontests", "code_contests", "codeforces")) else "lines"


def _loads(value: Any, what: str) -> Any:
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not JSON: {exc} (starts {value[:80]!r})") from exc
    return value


def _texts(values: Any, what: str) -> list[str]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, (list, tuple)):  # APPS sometimes stores an output as its lines
            v = "\n".join(str(x) for x in v)
        if not isinstance(v, (str, int, float)):
            raise ValueError(f"{what}[{i}] must be text, got {type(v).__name__}")
        out.append(str(v))
    return out


def _call_args(value: Any, where: str) -> tuple[Any, ...]:
    if isinstance(value, str):  # verl prime_code: one JSON argument a line
        try:
            return tuple(json.loads(line) for line in value.split("\n") if line.strip())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: call arguments are neither a list nor JSON lines: {exc}") from exc
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise ValueError(f"{where}: call arguments must be a list, got {type(value).__name__}")


def _call_expected(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _positive(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def parse_ground_truth(ground_truth: Any, data_source: str | None = None) -> Problem:
    """The :class:`Problem` of a code ground truth in any format of the module docstring.

    Raises:
        ValueError: naming what is wrong (not JSON, no cases, inputs and outputs of different lengths...).
    """
    gt = _loads(ground_truth, "code ground truth")
    if isinstance(gt, Mapping) and "input_output" in gt and "inputs" not in gt:
        extra = {k: v for k, v in gt.items() if k != "input_output"}
        gt = {**extra, **_loads(gt["input_output"], "code ground truth input_output")}
    notes: list[str] = []
    meta: Mapping[str, Any] = gt if isinstance(gt, Mapping) else {}
    compare = meta.get("compare") or compare_mode_for(data_source)
    if compare not in MODES:
        raise ValueError(f"code ground truth compare={compare!r}: use one of {MODES}")
    checker = bool(meta.get("generated_checker") or meta.get("checker"))
    limits = {"time_limit": _positive(meta.get("time_limit")), "memory_limit_mb": None}
    mem = _positive(meta.get("memory_limit"))
    limits["memory_limit_mb"] = int(mem) if mem else None

    cases: list[TestCase] = []
    fn_name = None
    if isinstance(gt, Mapping) and "inputs" in gt:
        fmt = "apps"
        if "outputs" not in gt:
            raise ValueError("code ground truth has inputs but no outputs")
        inputs, outputs = gt["inputs"], gt["outputs"]
        if not isinstance(inputs, (list, tuple)) or not isinstance(outputs, (list, tuple)):
            raise ValueError("code ground truth inputs and outputs must be lists")
        if len(inputs) != len(outputs):
            raise ValueError(f"code ground truth has {len(inputs)} inputs but {len(outputs)} outputs")
        fn_name = gt.get("fn_name") or None
        if fn_name is not None:
            if not isinstance(fn_name, str) or not fn_name.isidentifier():
                raise ValueError(f"code ground truth fn_name {fn_name!r} is not a Python identifier")
            for i, (a, o) in enumerate(zip(inputs, outputs, strict=True)):
                cases.append(TestCase(args=_call_args(a, f"case {i}"), expected=_call_expected(o)))
        else:
            ins, outs = _texts(inputs, "inputs"), _texts(outputs, "outputs")
            cases = [TestCase(stdin=a, expected=o) for a, o in zip(ins, outs, strict=True)]
    elif isinstance(gt, Mapping) and (any(k in gt for k in GROUPS) or ("input" in gt and "output" in gt)):
        fmt = "codeforces" if "official_tests" in gt else "codecontests"
        groups = (("official_tests", "generated_tests") if fmt == "codeforces" else
                  ("public_tests", "private_tests", "generated_tests"))
        parts = [gt[g] for g in groups if gt.get(g)] if any(g in gt for g in groups) else [gt]
        for g in parts:
            cases += _group_cases(g)
        if "compare" not in meta and data_source is None:
            compare = "tokens"
    elif isinstance(gt, (list, tuple)):
        fmt = "codeforces"
        cases = _group_cases(gt)
        if data_source is None:
            compare = "tokens"
    else:
        raise ValueError(f"code ground truth of an unknown layout ({type(gt).__name__}"
                         f"{' with keys ' + str(sorted(gt)[:8]) if isinstance(gt, Mapping) else ''}): expected "
                         "APPS/TACO inputs/outputs, CodeContests test groups or Codeforces official_tests")
    if not cases:
        raise ValueError("code ground truth holds no test cases")
    if checker:
        notes.append("the problem has a special checker; outputs were compared with the "
                     f"{compare!r} rule instead")
    return Problem(tuple(cases), compare, fn_name, limits["time_limit"], limits["memory_limit_mb"], checker, fmt,
                   tuple(notes))


def _group_cases(group: Any) -> list[TestCase]:
    if isinstance(group, Mapping):
        ins = _texts(group.get("input", []), "test input")
        outs = _texts(group.get("output", []), "test output")
        if len(ins) != len(outs):
            raise ValueError(f"a test group has {len(ins)} inputs but {len(outs)} outputs")
        return [TestCase(stdin=a, expected=o) for a, o in zip(ins, outs, strict=True)]
    if isinstance(group, (list, tuple)):
        out = []
        for i, case in enumerate(group):
            if not isinstance(case, Mapping) or "input" not in case or "output" not in case:
                raise ValueError(f"test case {i} must be an object with input and output")
            out.append(TestCase(stdin=str(case["input"]), expected=str(case["output"])))
        return out
    raise ValueError(f"a test group must be an object or a list, got {type(group).__name__}")


# ---------------------------------------------------------------------------------------------- comparison
def _numbers(lines: Sequence[str]) -> list[float] | None:
    try:
        return [float(x) for x in lines]
    except ValueError:
        return None


def _is_int(text: str) -> bool:
    t = text.strip()
    return t.lstrip("+-").isdigit()


def lines_match(output: str, expected: str) -> bool:
    """APPS / TACO: lines trimmed, blank lines dropped, equal; or close as numbers (not all integers)."""
    got = [ln.strip() for ln in output.splitlines() if ln.strip()]
    want = [ln.strip() for ln in str(expected).splitlines() if ln.strip()]
    if got == want:
        return True
    if len(got) != len(want) or all(_is_int(x) for x in got + want):
        return False
    a, b = _numbers(got), _numbers(want)
    if a is None or b is None:
        return False
    return all(math.isfinite(x) and math.isfinite(y) and abs(x - y) <= 1e-8 + 1e-5 * abs(y)
               for x, y in zip(a, b, strict=True))


def _token_number(token: str) -> tuple[bool, float | None]:
    """``(is_integer, value)`` of a numeric token, ``(False, None)`` for any other text."""
    try:
        return True, float(int(token))
    except ValueError:
        pass
    try:
        value = float(token)
    except ValueError:
        return False, None
    return False, value if math.isfinite(value) else None


def tokens_match(output: str, expected: str) -> bool:
    """CodeContests / Codeforces: whitespace-separated tokens, case-insensitive; floats within 1e-5."""
    got = output.lower().split()
    want = str(expected).lower().split()
    if got == want:
        return True
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if a == b:
            continue
        a_int, a_val = _token_number(a)
        b_int, b_val = _token_number(b)
        if a_val is None or b_val is None:
            return False  # text tokens must be equal
        if a_int and b_int:
            return False  # two different integers
        if not abs(a_val - b_val) < 1e-5:
            return False
    return True


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def call_matches(result: Any, expected: Any) -> bool:
    """APPS / TACO call cases: equal, or equal to the only element of a one-element expected list."""
    got, want = _plain(result), _plain(expected)
    if got == want:
        return True
    return isinstance(want, list) and len(want) == 1 and got == want[0]


def outputs_match(output: str, expected: Any, mode: CompareMode) -> bool:
    """A stdin/stdout case's output against the expected text under ``mode`` (``lines`` or ``tokens``)."""
    return tokens_match(output, expected) if mode == "tokens" else lines_match(output, expected)
