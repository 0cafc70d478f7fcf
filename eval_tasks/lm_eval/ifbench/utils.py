"""IFBench (Pyatkin et al., 2025) scored by lighteval's IFBench instruction checkers, used as a library.

The prompts are ``allenai/IFBench_test`` (split ``train``: ``key``, ``prompt``, ``instruction_id_list``,
``kwargs``), the dataset lighteval 0.13.0's ``ifbench_test`` reads; a local copy is read from
``APERTUS_EVAL_DATA_IFBENCH`` (or ``APERTUS_EVAL_DATA/ifbench``). Each visible answer (the thinking
span stripped) goes through ``lighteval.tasks.tasks.ifbench.evaluation_lib``'s strict and loose tests
(loose: also with the first or last line, or the asterisks, removed), one instruction at a time so a
checker that fails names its instruction; a prompt is followed when all its instructions are.

What the checkers read besides their packages (nltk, spacy, syllapy, emoji, installed with lighteval):

- nltk data: ``punkt_tab`` (word tokenization: ``words:start_verb``, ``words:keywords_specific_position``,
  ``words:words_position``, ``format:title_case``), ``averaged_perceptron_tagger_eng``
  (``words:start_verb``) and ``stopwords`` (``ratio:stop_words``). This task downloads nothing while it
  scores: install them once (:data:`NLTK_FIX`). A checker that finds one missing stops the task with
  :class:`IFBenchDataError` naming the item, the instruction and the command; it is never scored as
  followed, nor dropped.
- lighteval downloads that nltk data, and spaCy's ``en_core_web_sm`` model with pip from outside PyPI,
  the first time it builds a checker. No IFBench checker reads the spaCy model, so this task turns that
  step off (lighteval's own ``RESOURCES_DOWNLOADED`` flag).

A checker that raises on a response (an answer in a shape it cannot parse: ``format:emoji`` on a
sentence of punctuation alone) counts that instruction as not followed, is logged with the reason and
counted in ``checker_error`` (the share of prompts where it happened): one response costs only itself.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from apertus_plugins.posttrain.evaluation import strip_thinking
from eval_tasks.data import load_splits
from eval_tasks.lm_eval.common import with_degeneration

TASK = "apertus_ifbench"
KEY = "ifbench"
HUB = "allenai/IFBench_test"
#: the nltk data the checkers read, and how to install it
NLTK_DATA = ("punkt_tab", "averaged_perceptron_tagger_eng", "stopwords")
NLTK_FIX = f"python -m nltk.downloader {' '.join(NLTK_DATA)} (or point NLTK_DATA at a folder that has them)"

log = logging.getLogger(__name__)


class IFBenchDataError(LookupError):
    """A checker needs nltk data that is not installed; the message names the item, the instruction and the fix."""


def load(**kwargs: Any):
    """The ``train`` split of IFBench_test: the local copy when one is set, else the hub's."""
    return load_splits(TASK, KEY, ["train"], hub=HUB)


@functools.cache
def checkers() -> ModuleType:
    """lighteval's ``evaluation_lib`` of IFBench, with lighteval's download-on-first-checker step off."""
    from importlib.metadata import PackageNotFoundError, version

    from apertus_plugins.infra.versions import UnsupportedVersionError, require

    try:
        found: str | None = version("lighteval")
    except PackageNotFoundError:
        found = None
    try:
        require("lighteval", found)
    except UnsupportedVersionError as exc:
        raise ImportError(f"task {TASK} scores with lighteval's IFBench checkers: {exc} "
                          "(pip install 'apertus-plugins[eval]')") from None
    from lighteval.tasks.tasks.ifbench import evaluation_lib, instructions

    instructions.RESOURCES_DOWNLOADED = True  # no downloads while scoring (see the module docstring)
    return evaluation_lib


def _kwargs(raw: Any) -> dict[str, Any]:
    """One instruction's arguments: a hub row carries every instruction's keys, None where unused."""
    return {k: v for k, v in dict(raw or {}).items() if v is not None}


def _test(lib: ModuleType, fn: Callable[..., Any], item: str, prompt: str, iid: str, kwargs: dict[str, Any],
          answer: str) -> tuple[bool, str | None]:
    """Whether ``answer`` follows one instruction under ``fn`` (strict or loose), and the checker's error."""
    example = lib.InputExample(key=0, instruction_id_list=[iid], prompt=prompt, kwargs=[dict(kwargs)])
    try:
        return bool(fn(example, {prompt: answer}).follow_all_instructions), None
    except LookupError as exc:
        if isinstance(exc, (IndexError, KeyError)):  # LookupErrors too, but of the checker's own parsing
            return _unparsed(item, iid, exc)
        missing = re.search(r"Resource \S+ not found", str(exc))
        raise IFBenchDataError(f"task {TASK}, item {item}: instruction {iid!r} needs nltk data that is not installed"
                               f"{f' ({missing.group(0)})' if missing else ''}: {NLTK_FIX}") from exc
    except ImportError:  # a checker's package is missing (lighteval's placeholder): not the response's fault
        raise
    except Exception as exc:  # a response the checker cannot parse: not followed, and said so
        return _unparsed(item, iid, exc)


def _unparsed(item: str, iid: str, exc: Exception) -> tuple[bool, str]:
    reason = f"{type(exc).__name__}: {exc}"
    log.warning("task %s, item %s: the checker of %r raised on the response (%s); counted as not followed",
                TASK, item, iid, reason)
    return False, reason


def score(doc: dict[str, Any], response: str) -> dict[str, Any]:
    """The IFBench scores of one response to ``doc`` (see the module docstring)."""
    lib = checkers()
    item = str(doc.get("key", "?"))
    ids: Sequence[str] = list(doc["instruction_id_list"])
    raw = list(doc["kwargs"] or [])
    if len(raw) != len(ids):
        raise ValueError(f"task {TASK}, item {item}: {len(ids)} instructions but {len(raw)} kwargs entries")
    known = lib.instructions_registry.INSTRUCTION_DICT
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise ValueError(f"task {TASK}, item {item}: unknown instruction ids {unknown} (lighteval's IFBench "
                         f"registry has {len(known)})")
    for iid, kw in zip(ids, raw, strict=True):
        params = inspect.signature(known[iid].build_description).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        extra = set() if takes_any else set(_kwargs(kw)) - set(params)
        if extra:
            raise ValueError(f"task {TASK}, item {item}: instruction {iid!r} takes no arguments {sorted(extra)}")
    answer = strip_thinking(response)
    strict, loose, errors = [], [], []
    for iid, kw in zip(ids, raw, strict=True):
        s, e1 = _test(lib, lib.test_instruction_following_strict, item, doc["prompt"], iid, _kwargs(kw), answer)
        lo, e2 = _test(lib, lib.test_instruction_following_loose, item, doc["prompt"], iid, _kwargs(kw), answer)
        strict.append(s)
        loose.append(lo)
        errors += [e for e in (e1, e2) if e]
    return {"prompt_level_strict_acc": float(all(strict)), "prompt_level_loose_acc": float(all(loose)),
            "inst_level_strict_acc": strict, "inst_level_loose_acc": loose, "checker_error": float(bool(errors))}


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """The IFBench scores of the first answer, and ``degenerate`` (the whole response, thinking included)."""
    return with_degeneration(results[0], score(doc, results[0]))


def agg_inst_level_acc(items: list[list[bool]]) -> float:
    """The share of instructions followed, over every prompt's instructions."""
    flat = [x for sub in items for x in sub]
    return sum(flat) / len(flat) if flat else 0.0
