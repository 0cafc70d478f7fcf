"""Charter alignment (report Table L.2: "Swiss AI Charter Alignment, length-controlled win rate").

Each answer (thinking stripped) is compared with a baseline answer to the same prompt by an
OpenAI-compatible judge that sees the charter (:meth:`apertus_plugins.posttrain.judges.OpenAIJudge.preference`:
the judge's probability that the answer follows the charter better, read from its
log-probabilities and averaged over both presentation orders). The score is the length-controlled
win rate (:func:`apertus_plugins.posttrain.evaluation.length_controlled_win_rate`, AlpacaEval 2's
length control: the win rate the judge would give if both answers had the same length, so a
model does not win by writing more); ``win_rate`` (the raw mean preference) is reported beside it.

The baseline answers: the report does not publish the ones it compares against, so they are the
user's stand-in, given with the prompts (a ``baseline`` column: for example a reference model's
answers to the same prompts, generated once with the same protocol). Lengths are counted in
characters of the visible answers.

Settings (environment):

- ``APERTUS_EVAL_JUDGE_URL``: the judge's ``/v1`` URL (required);
- ``APERTUS_EVAL_JUDGE_MODEL``: the judge's served model name (required);
- ``APERTUS_EVAL_JUDGE_API_KEY``: its API key, where it needs one;
- ``APERTUS_EVAL_CHARTER``: the charter, a ``.txt``/``.md`` file (required: a preference under any
  other text is meaningless);
- ``APERTUS_EVAL_JUDGE_TOP_LOGPROBS``: alternatives read for the verdict token (default 20);
- the prompts and baseline answers: ``APERTUS_EVAL_DATA_CHARTER_ALIGNMENT`` (or
  ``APERTUS_EVAL_DATA/charter_alignment``), a ``test`` split with ``prompt`` and ``baseline`` columns.

The judge is checked when the task loads, so an unreachable judge fails before any generation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from typing import Any

from apertus_plugins.posttrain.evaluation import length_controlled_win_rate, strip_thinking
from apertus_plugins.posttrain.judges import JudgeError, OpenAIJudge
from eval_tasks.catalogue import CHARTER_ENV, JUDGE_URL_ENV
from eval_tasks.data import DataPathError, load_splits
from eval_tasks.lm_eval.common import JudgeSettingError, named_judge, with_degeneration

TASK = "apertus_charter_alignment"
ASPECT = "alignment with the charter"
URL, CHARTER = JUDGE_URL_ENV, CHARTER_ENV


@cache
def judge() -> OpenAIJudge:
    """The task's judge, built from the environment (the charter it reads first) and checked once."""
    charter = os.environ.get(CHARTER, "").strip()
    if not charter:
        raise JudgeSettingError(f"task {TASK}: no charter; set {CHARTER} to the charter's .txt or .md file")
    if not os.path.isfile(charter):
        raise JudgeSettingError(f"task {TASK}: the charter file {charter} given by {CHARTER} does not exist")
    return named_judge(TASK, charter="@" + charter, aspect=ASPECT)


def load(**kwargs: Any):
    """The prompts and baseline answers (``test``); checks the judge first so a bad setting fails before generation."""
    judge()
    data = load_splits(TASK, "charter_alignment", ["test"], why="the charter-alignment prompts are not on a hub")
    missing = {"prompt", "baseline"} - set(data["test"].column_names)
    if missing:
        raise DataPathError(f"task {TASK}: the prompts lack the column(s) {sorted(missing)}: each prompt needs the "
                            "baseline answer the model's answer is compared with (see the module docstring)")
    return data


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """Per item: the judge's preference for the answer over the baseline with both lengths
    (``lc_win_rate``, aggregated by :func:`lc_win_rate`), the preference alone (``win_rate``) and ``degenerate``."""
    response = results[0]
    answer, baseline = strip_thinking(response), str(doc["baseline"])
    try:
        preference = judge().preference(doc["prompt"], answer, baseline)
    except JudgeError as exc:
        raise JudgeSettingError(f"task {TASK}: the judge given by {URL} failed: {exc}") from exc
    return with_degeneration(response, {"lc_win_rate": (preference, len(answer), len(baseline)),
                                        "win_rate": preference})


def lc_win_rate(items: Sequence[Sequence[float]]) -> float:
    """The length-controlled win rate over the items' ``(preference, length, baseline length)``."""
    prefs, lengths, base = zip(*items, strict=True)
    return length_controlled_win_rate(prefs, lengths, base).lc_win_rate
