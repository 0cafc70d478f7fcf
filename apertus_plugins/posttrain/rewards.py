"""Verifiable reward functions for the Apertus RL stage (SPEC section 6).

Each function has the hook signature ``reward(response, ground_truth, **kw) -> float`` and reads
the model's final answer the same way: the response is parsed by the core output parser
(:func:`apertus_plugins.core.chat.read_output`: the thinking span in either surface form is removed,
tool calls are decoded), and when the model called the dedicated answer tool, its argument is
the answer; otherwise the visible text is.

* ``math_verify``: Math-Verify (``math-verify`` on PyPI) against the gold answer; 1.0 or 0.0.
* ``ifeval``: the IFEval constraint checkers of lm-eval (``lm-eval`` on PyPI, reused, not
  rewritten); the ground truth is ``{"instruction_id_list": [...], "kwargs": [...]}``; the
  reward is 1.0 when every instruction is followed (``strict``) or the fraction followed.
* ``exact_match``: normalized string equality with the gold answer (or any of several).
* ``code``: the program in the answer (its last fenced Python block, else the whole answer) run against the
  problem's test cases in the code sandbox (:mod:`apertus_plugins.posttrain.sandbox`): 1.0 only when every
  case passes. It returns a mapping ``{"score": 1.0 or 0.0, "verdict": {...}}``: the verdict of every case
  (passed, wrong_answer, runtime_error, timeout, memory_limit, output_limit, file_limit, sandbox_error,
  skipped), the backend and the comparison rule. A reward function returns a float, or such a mapping whose
  ``score`` is the reward and whose other keys are extra information.

They register through the core's ``apertus_reward_functions`` hook, so the verl adapter (and any
other trainer) looks them up by name.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from apertus_plugins.plugins.hooks import hookimpl

__all__ = [
    "ANSWER_TOOL",
    "extract_answer",
    "math_verify_reward",
    "ifeval_reward",
    "exact_match_reward",
    "code_reward",
    "normalize_text",
]

#: The answer tool: its name and the argument holding the answer. Configurable per call.
ANSWER_TOOL = {"name": "answer", "argument": "answer"}


def extract_answer(response: str, tool_name: str = ANSWER_TOOL["name"],
                   argument: str = ANSWER_TOOL["argument"], require_tool: bool = False) -> str | None:
    """The final answer of a generation (text, Apertus markup included).

    The generation is read as evaluation reads it (:func:`apertus_plugins.core.chat.read_output`: the
    answer follows the last closing thinking delimiter). The last call to ``tool_name`` outside the
    thinking wins; its ``argument`` (or, if the call has a single argument, that one) is the answer,
    JSON-encoded when it is not a string. Without such a call the visible content is the answer,
    unless ``require_tool`` (then ``None``). An unclosed thinking span leaves no answer (``None``).
    """
    from apertus_plugins.core.chat import read_output

    parsed = read_output(response)
    calls = [c for c in parsed.tool_calls if c.name == tool_name and not c.in_thinking]
    if calls:
        args = calls[-1].arguments
        if argument in args:
            value = args[argument]
        elif len(args) == 1:
            (value,) = args.values()
        else:
            return None
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if require_tool:
        return None
    content = parsed.content.strip()
    if parsed.thinking is not None and not content:
        return None
    return content


def normalize_text(text: str, casefold: bool = True) -> str:
    """NFKC, collapsed whitespace, stripped surrounding quotes/periods, optionally case-folded."""
    t = unicodedata.normalize("NFKC", text)
    t = re.sub(r"\s+", " ", t).strip().strip("\"'").rstrip(".").strip()
    return t.casefold() if casefold else t


def _answer(response: str, kw: Mapping[str, Any]) -> str | None:
    return extract_answer(response, tool_name=kw.get("tool_name", ANSWER_TOOL["name"]),
                          argument=kw.get("argument", ANSWER_TOOL["argument"]),
                          require_tool=bool(kw.get("require_tool", False)))


def exact_match_reward(response: str, ground_truth: str | Sequence[str], **kw: Any) -> float:
    """1.0 when the answer equals the gold answer (or one of several) after :func:`normalize_text`."""
    answer = _answer(response, kw)
    if answer is None:
        return 0.0
    golds = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    casefold = bool(kw.get("casefold", True))
    a = normalize_text(answer, casefold)
    return 1.0 if any(a == normalize_text(str(g), casefold) for g in golds) else 0.0


def math_verify_reward(response: str, ground_truth: str, **kw: Any) -> float:
    """1.0 when Math-Verify finds the answer equivalent to the gold answer.

    The gold answer is parsed as given (wrap bare expressions in ``$...$`` or ``\\boxed{}`` as
    Math-Verify expects); the prediction is the extracted answer. Math-Verify's own timeouts use
    signals, which only work in the main thread; elsewhere they are off.
    """
    from math_verify import parse, verify

    answer = _answer(response, kw)
    if answer is None or not answer.strip():
        return 0.0
    main = threading.current_thread() is threading.main_thread()
    timeout = kw.get("timeout_seconds", 5) if main else None
    gold = parse(str(ground_truth), parsing_timeout=timeout)
    pred = parse(answer, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"Math-Verify cannot parse the gold answer {ground_truth!r}")
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def _instruction_registry() -> Mapping[str, Any]:
    try:
        from lm_eval.tasks.ifeval import instructions_registry
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the ifeval reward needs lm-eval with its ifeval extra (langdetect, immutabledict, "
                          "nltk): pip install 'apertus-plugins[verl]'") from exc
    return instructions_registry.INSTRUCTION_DICT


def ifeval_reward(response: str, ground_truth: Mapping[str, Any] | str, **kw: Any) -> float:
    """IFEval-style constraint checks with lm-eval's checkers.

    ``ground_truth``: ``{"instruction_id_list": [...], "kwargs": [{...}, ...], "prompt": ...}``
    (the IFEval record layout) or its JSON. ``strict=True`` (default) gives 1.0 only when every
    instruction is followed, else the fraction followed. ``None`` kwargs values are dropped, as
    lm-eval does.
    """
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    ids = list(gt.get("instruction_id_list") or [])
    kwargs_list = list(gt.get("kwargs") or [{} for _ in ids])
    if not ids or len(kwargs_list) != len(ids):
        raise ValueError(f"ifeval ground truth needs instruction_id_list and one kwargs entry per instruction; "
                         f"got {gt!r:.200}")
    answer = _answer(response, kw)
    if answer is None or not answer.strip():
        return 0.0
    registry = _instruction_registry()
    followed = []
    for iid, params in zip(ids, kwargs_list, strict=True):
        if iid not in registry:
            raise ValueError(f"unknown IFEval instruction id {iid!r}")
        checker = registry[iid](iid)
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        checker.build_description(**clean)
        args = checker.get_instruction_args()
        if args and "prompt" in args and gt.get("prompt") is not None:
            checker.build_description(prompt=gt["prompt"])
        try:
            followed.append(bool(answer.strip() and checker.check_following(answer)))
        except LookupError as exc:  # nltk data (punkt_tab) the sentence checkers load on first use
            raise LookupError(f"IFEval instruction {iid!r} needs nltk data that is not installed "
                              f"(python -m nltk.downloader punkt_tab, or set NLTK_DATA): {str(exc).strip()[:300]}"
                              ) from exc
    if kw.get("strict", True):
        return 1.0 if all(followed) else 0.0
    return sum(followed) / len(followed)


def code_reward(response: str, ground_truth: Any, **kw: Any) -> dict[str, Any]:
    """1.0 when the response's program passes every test case of ``ground_truth``, run in the code sandbox.

    ``ground_truth``: any layout :func:`apertus_plugins.posttrain.sandbox.parse_ground_truth` reads (APPS/TACO
    ``{"inputs", "outputs"[, "fn_name"]}``, CodeContests test groups, Codeforces ``official_tests``), or its JSON.
    Keyword options: ``data_source`` (picks the output comparison: ``tokens`` for CodeContests and
    Codeforces, ``lines`` otherwise), ``runner`` (a :class:`~apertus_plugins.posttrain.sandbox.CodeRunner`;
    default the process's local bubblewrap sandbox, configured by ``sandbox``: a mapping of
    :func:`~apertus_plugins.posttrain.sandbox.local_sandbox` options), ``stop_on_failure`` (default true: the
    cases after the first failure are ``skipped``), and the answer-tool options of the other rewards.

    A ground truth that cannot be read scores 0 with the parse error in the verdict (one bad record costs
    only itself); a sandbox that cannot run at all raises
    :class:`~apertus_plugins.posttrain.sandbox.SandboxUnavailable`.
    """
    from .sandbox import Verdict, extract_program, judge_program, local_sandbox
    from .sandbox import parse_ground_truth as parse

    runner = kw.get("runner") or local_sandbox(kw.get("sandbox"))
    try:
        problem = parse(ground_truth, data_source=kw.get("data_source"))
    except ValueError as exc:
        verdict = Verdict(False, [], runner.name, "", error=f"invalid code ground truth: {exc}")
        return {"score": 0.0, "verdict": verdict.to_dict()}
    program = extract_program(_answer(response, kw))
    verdict = judge_program(runner, program, problem, stop_on_failure=bool(kw.get("stop_on_failure", True)))
    return {"score": verdict.score, "verdict": verdict.to_dict()}


REWARD_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "math_verify": math_verify_reward,
    "ifeval": ifeval_reward,
    "exact_match": exact_match_reward,
    "code": code_reward,
}


@hookimpl
def apertus_reward_functions() -> dict[str, Callable[..., Any]]:
    return dict(REWARD_FUNCTIONS)
