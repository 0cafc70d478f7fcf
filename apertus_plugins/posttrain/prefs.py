"""Offline DPO pairs from a scored response pool, as the report builds them (section 4.6.1, Appendix I.1).

A pool holds prompts, each with several responses (the report: 24 models answer every prompt). A judge
rates every response on four aspects, one request per aspect with :data:`SYSTEM_PROMPT` as the system
message and the aspect's rubric (:data:`ASPECTS`) as the user message; the rating is the expected value
of the judge's distribution over the digits 1..5 of its one generated token (greedy, thinking off), read
from the digits' log-probabilities and renormalized over them. A response's score is the mean over the
aspects; each prompt gives one pair by MaxMin: its best-scored response chosen, its worst rejected.

:func:`build_preference_pairs` does it resumably: every judgement is appended to ``judgements.jsonl`` in
the output folder as it arrives (the judge's answer kept for audit: its token and the digits'
log-probabilities), keyed by the content it rated, so a run that is killed and started again rates only
what is missing. A judgement that failed (after the HTTP client's retries) is recorded and tried again on
the next run. ``pairs.jsonl`` (written whole, then renamed) is what the offline DPO trainer reads
(:func:`verl_ext.dpo.load_pair_file`): ``{"prompt": messages, "chosen": str, "rejected": str, ...}``, with
the pair's models and scores beside; ``summary.json`` counts prompts, responses, judgements, failures,
ties and pairs.

The rubrics below are written from the report's description (ActiveUltraFeedback-style rubrics, one digit
from 1 to 5 per aspect); the report's exact prompt text is not reproduced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apertus_plugins.infra.files import write_text_atomic

from .judges import PROMPT_SECTION, RESPONSE_SECTION

__all__ = [
    "ASPECTS",
    "SYSTEM_PROMPT",
    "PoolItem",
    "PrefsSummary",
    "Response",
    "build_preference_pairs",
    "judgement_key",
    "maxmin",
    "read_pool",
    "render_prompt",
]

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = """You are an impartial expert annotator of AI assistant responses. You rate one response to one \
user prompt on one aspect at a time, following the rubric you are given for that aspect and nothing else. \
Judge the response as written: its length, its style or the identity of its author earn no credit by \
themselves. Answer with a single digit from 1 to 5 and nothing else."""

_FRAME = "\n\n".join(["Aspect: {aspect}", "{rubric}", PROMPT_SECTION, RESPONSE_SECTION,
                       "Rate the response's {aspect} with one digit from 1 to 5."])

#: aspect -> rubric (the report's four aspects, section 4.6.1: truthfulness, helpfulness, honesty,
#: instruction following; a 1..5 scale each)
RUBRICS: dict[str, str] = {
    "truthfulness": """Truthfulness: are the statements in the response correct, and free of invented facts, \
misread premises and contradictions, with respect to the prompt and to world knowledge?
5 - Everything stated is correct; nothing is invented or contradicted.
4 - Correct apart from a slip that does not change the substance.
3 - Partly correct: some statements are wrong or unsupported, but the core holds.
2 - Largely wrong: important statements are false, invented, or contradict the prompt.
1 - Entirely unreliable: fabricated or false throughout.""",
    "helpfulness": """Helpfulness: does the response do what the user needs: is it relevant, correct, complete \
enough and clear, with useful detail and without filler or needless repetition?
5 - Fully solves the task, clearly and with the right amount of useful detail.
4 - Solves the task well; minor gaps or slightly more or less detail than ideal.
3 - Useful but incomplete, partly off target, or hard to follow.
2 - Of little use: it misses most of what was asked or is mostly filler.
1 - Useless or harmful for the user's goal.""",
    "honesty": """Honesty: does the response express its confidence as it should: sure where it is right, \
uncertain where it may be wrong, declining or saying it does not know where it cannot answer, and never \
presenting a guess as a fact?
5 - Confidence matches correctness throughout; limits are stated where they matter.
4 - Well calibrated, with a small lapse (a hedge missing or superfluous).
3 - Some confident statements that should be hedged, or uncertainty where none is due.
2 - Mostly confident about what it gets wrong, or evasive where it could answer.
1 - Confidently wrong, or it misrepresents what it knows or what it did.""",
    "instruction_following": """Instruction following: does the response comply with everything the prompt asks \
for: the task itself and every stated constraint (format, length, language, style, what to include or leave out)?
5 - Follows every instruction and constraint.
4 - Follows the instructions with a minor deviation.
3 - Follows the main task but misses or bends some constraints.
2 - Follows few of the instructions; the main task is addressed poorly.
1 - Ignores the instructions or does a different task.""",
}

#: aspect -> user message template (``{prompt}`` and ``{response}`` are filled in, nothing else)
ASPECTS: dict[str, str] = {a: _FRAME.replace("{aspect}", a.replace("_", " ")).replace("{rubric}", r)
                           for a, r in RUBRICS.items()}

PAIRS_FILE = "pairs.jsonl"
JOURNAL_FILE = "judgements.jsonl"
SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class Response:
    text: str
    model: str = ""


@dataclass(frozen=True)
class PoolItem:
    """A prompt (chat messages) and its candidate responses."""

    id: str
    prompt: tuple[Mapping[str, Any], ...]
    responses: tuple[Response, ...]


# ------------------------------------------------------------------------------------------ reading a pool
_TEXT_KEYS = ("response", "text", "content", "completion", "output")
_MODEL_KEYS = ("model", "source_model", "model_name", "generator")


def _response(value: Any, where: str) -> Response:
    if isinstance(value, str):
        return Response(value)
    if isinstance(value, Mapping):
        text = next((value[k] for k in _TEXT_KEYS if isinstance(value.get(k), str)), None)
        if text is None:
            raise ValueError(f"{where}: a response object needs its text under one of {list(_TEXT_KEYS)}")
        model = next((str(value[k]) for k in _MODEL_KEYS if value.get(k) is not None), "")
        return Response(text, model)
    raise ValueError(f"{where}: a response must be text or an object, got {type(value).__name__}")


def _item(record: Mapping[str, Any], where: str, n: int, fields: Mapping[str, str]) -> PoolItem:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a pool record is an object, got {type(record).__name__}")
    for key in (fields["prompt"], fields["responses"]):
        if key not in record:
            raise ValueError(f"{where}: missing {key!r} (the record has {sorted(record)[:10]})")
    prompt = record[fields["prompt"]]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if (not isinstance(prompt, (list, tuple)) or not prompt
            or not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)):
        raise ValueError(f"{where}: {fields['prompt']!r} must be text or a non-empty list of messages with role "
                         "and content")
    raw = record[fields["responses"]]
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{where}: {fields['responses']!r} must be a list, got {type(raw).__name__}")
    responses = tuple(_response(r, f"{where}: response {i}") for i, r in enumerate(raw))
    rid = record.get(fields["id"])
    return PoolItem(str(rid) if rid is not None else str(n), tuple(dict(m) for m in prompt), responses)


def _records(source: str | os.PathLike[str], split: str) -> Iterator[tuple[str, Any]]:
    path = Path(source)
    if path.is_file():
        with path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{n}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not JSON: {exc}") from exc
        return
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(f"{source} is not a JSON-lines file, and reading it as a Hugging Face dataset needs "
                         "`datasets` (pip install datasets)") from exc
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{path} has splits {sorted(ds)}, not {split!r} (--split)")
            ds = ds[split]
    else:
        ds = datasets.load_dataset(str(source), split=split)
    for n, rec in enumerate(ds):
        yield f"{source}[{split}][{n}]", rec


def read_pool(source: str | os.PathLike[str], *, prompt_field: str = "prompt", responses_field: str = "responses",
              id_field: str = "id", split: str = "train", limit: int | None = None) -> list[PoolItem]:
    """The pool's records: a JSON-lines file, a dataset saved with ``save_to_disk``, or a Hub id (from the cache).

    A record: ``{"id": ..., "prompt": text or messages, "responses": [text or {"model": ..., "response": ...}]}``
    (field names configurable). A malformed record is an error naming the source and line; two records with
    the same id are an error.
    """
    fields = {"prompt": prompt_field, "responses": responses_field, "id": id_field}
    items: list[PoolItem] = []
    seen: dict[str, str] = {}
    for n, (where, rec) in enumerate(_records(source, split)):
        if limit is not None and len(items) >= limit:
            break
        item = _item(rec, where, n, fields)
        if item.id in seen:
            raise ValueError(f"{where}: id {item.id!r} is also the id of {seen[item.id]}")
        seen[item.id] = where
        items.append(item)
    if not items:
        raise ValueError(f"the pool {source} holds no records")
    return items


def render_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt as the judge reads it: the user's text, or the whole conversation when there are several turns."""
    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        return str(content)

    turns = [m for m in messages if m.get("role") != "system"]
    if len(turns) == 1:
        return text(turns[0]["content"])
    return "\n\n".join(f"[{m['role']}]\n{text(m['content'])}" for m in messages)


def judgement_key(aspect: str, prompt: Sequence[Mapping[str, Any]], response: str) -> str:
    """The journal key of one judgement: what was rated (a response moved elsewhere in the pool keeps its key)."""
    blob = json.dumps([aspect, list(prompt), response], ensure_ascii=False, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


# ------------------------------------------------------------------------------------------ MaxMin
def maxmin(scores: Sequence[float], min_margin: float = 0.0) -> tuple[int, int] | None:
    """``(best, worst)`` indices of one prompt's scored responses, or ``None`` when there is no preference.

    The highest score is chosen and the lowest rejected; among equal scores the earlier response is taken.
    No pair when fewer than two responses are scored or the best and worst differ by ``min_margin`` or less
    (ties carry no preference). NaN is an error.
    """
    vals = [float(s) for s in scores]
    if any(math.isnan(v) for v in vals):
        raise ValueError(f"NaN among the scores {vals}")
    if len(vals) < 2:
        return None
    best = max(range(len(vals)), key=lambda i: (vals[i], -i))
    worst = min(range(len(vals)), key=lambda i: (vals[i], i))
    if vals[best] - vals[worst] <= min_margin:
        return None
    return best, worst


# ------------------------------------------------------------------------------------------ the journal
class Journal:
    """The append-only record of judgements: one JSON line each, flushed as written (a kill loses at most the
    line being written, which the next run drops)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, dict[str, Any]] = {}
        if path.exists():
            self._load()
        self._fh = path.open("a", encoding="utf-8")

    def _load(self) -> None:
        data = self.path.read_bytes()
        good = 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # the line a killed run was writing
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            good += len(line)
            if "score" in rec:
                self.records[rec["key"]] = rec
                self.failures.pop(rec["key"], None)
            elif rec["key"] not in self.records:
                self.failures[rec["key"]] = rec
        if good < len(data):
            logger.warning("%s: dropping %d bytes of an unfinished line", self.path, len(data) - good)
            with self.path.open("r+b") as fh:
                fh.truncate(good)

    def append(self, rec: dict[str, Any]) -> None:
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()
        if "score" in rec:
            self.records[rec["key"]] = rec
            self.failures.pop(rec["key"], None)
        else:
            self.failures[rec["key"]] = rec

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()


# ------------------------------------------------------------------------------------------ the run
@dataclass
class PrefsSummary:
    """Counts of one run (written to ``summary.json``)."""

    prompts: int = 0
    responses: int = 0
    empty_responses: int = 0
    judgements: int = 0  # distinct (aspect, prompt, response) ratings the pool needs
    judgements_reused: int = 0  # of those, found in the journal of an earlier run
    judgements_made: int = 0
    judgements_failed: int = 0
    responses_unscored: int = 0
    prompts_too_few_scored: int = 0
    prompts_tied: int = 0
    best_shared: int = 0
    worst_shared: int = 0
    pairs: int = 0
    margin_mean: float = 0.0
    chosen_score_mean: float = 0.0
    rejected_score_mean: float = 0.0
    aspects: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _judge_one(judge: Any, template: str, prompt_text: str, response: str) -> dict[str, Any]:
    from .judges import fill_template

    rating = judge.rate_message(fill_template(template, prompt=prompt_text, response=response))
    return {"score": rating.value, "probs": {str(k): v for k, v in rating.probs.items()}, "token": rating.token,
            "digit_logprobs": rating.digit_logprobs, "judge_model": rating.model}


def _tasks(items: Sequence[PoolItem], aspects: Mapping[str, str]) -> Iterator[tuple[str, str, PoolItem, int]]:
    for item in items:
        for r, resp in enumerate(item.responses):
            if not resp.text.strip():
                continue
            for aspect in aspects:
                yield judgement_key(aspect, item.prompt, resp.text), aspect, item, r


def build_preference_pairs(items: Sequence[PoolItem], judge: Any, out_dir: str | os.PathLike[str], *,
                           aspects: Mapping[str, str] | Iterable[str] | None = None, concurrency: int = 8,
                           min_margin: float = 0.0, progress: bool = True) -> PrefsSummary:
    """Score the pool with ``judge`` (an :class:`~apertus_plugins.posttrain.judges.OpenAIJudge` with :data:`SYSTEM_PROMPT`),
    journaled in ``out_dir``, then write the MaxMin pairs and the summary. Resumes from the journal.

    Args:
        items: the pool (:func:`read_pool`).
        judge: has ``rate_message(user_text) -> Rating`` (the HTTP client and its retries are the judge's).
        aspects: names from :data:`ASPECTS` or a mapping ``name -> template``; default all four.
        concurrency: requests to the judge at once.
        min_margin: prompts whose best and worst scores differ by no more than this give no pair.
    """
    from tqdm import tqdm

    from .judges import JudgeError, JudgeUnavailableError

    t0 = time.monotonic()
    if aspects is None:
        aspects = dict(ASPECTS)
    elif not isinstance(aspects, Mapping):
        names = list(aspects)
        unknown = [a for a in names if a not in ASPECTS]
        if unknown:
            raise ValueError(f"unknown aspects {unknown}; known: {list(ASPECTS)}")
        aspects = {a: ASPECTS[a] for a in names}
    if not aspects:
        raise ValueError("no aspects to judge")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = PrefsSummary(prompts=len(items), responses=sum(len(i.responses) for i in items),
                           empty_responses=sum(1 for i in items for r in i.responses if not r.text.strip()),
                           aspects=list(aspects))
    journal = Journal(out / JOURNAL_FILE)
    try:
        todo: dict[str, tuple[str, PoolItem, int]] = {}
        needed: set[str] = set()
        for key, aspect, item, r in _tasks(items, aspects):
            needed.add(key)  # identical responses to one prompt are one judgement
            if key not in journal.records and key not in todo:
                todo[key] = (aspect, item, r)
        summary.judgements = len(needed)
        summary.judgements_reused = len(needed) - len(todo)
        if summary.judgements_reused:
            logger.info("resuming: %d of %d judgements already in %s", summary.judgements_reused,
                        summary.judgements, journal.path)
        bar = tqdm(total=len(todo), desc="judging", unit="judgement", disable=not progress)
        pending: dict[Future, str] = {}
        queue = iter(todo.items())
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="prefs-judge") as pool:
            while True:
                while len(pending) < 2 * concurrency:
                    nxt = next(queue, None)
                    if nxt is None:
                        break
                    key, (aspect, item, r) = nxt
                    fut = pool.submit(_judge_one, judge, aspects[aspect], render_prompt(item.prompt),
                                      item.responses[r].text)
                    pending[fut] = key
                if not pending:
                    break
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    key = pending.pop(fut)
                    aspect, item, r = todo[key]
                    rec = {"key": key, "id": item.id, "response": r, "model": item.responses[r].model,
                           "aspect": aspect}
                    try:
                        rec.update(fut.result())
                        summary.judgements_made += 1
                    except JudgeUnavailableError:
                        # the judge is gone: stop (what was judged is in the journal; run again to resume)
                        for f in pending:
                            f.cancel()
                        raise
                    except (JudgeError, ValueError) as exc:  # this judgement only: recorded, retried next run
                        rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                        summary.judgements_failed += 1
                    journal.append(rec)
                    bar.update(1)
        bar.close()
        pairs = _pairs(items, aspects, journal, summary, min_margin)
    finally:
        journal.close()
    write_text_atomic(out / PAIRS_FILE, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))
    summary.seconds = round(time.monotonic() - t0, 3)
    write_text_atomic(out / SUMMARY_FILE, json.dumps(summary.__dict__, indent=2) + "\n")
    return summary


def _pairs(items: Sequence[PoolItem], aspects: Mapping[str, str], journal: Journal, summary: PrefsSummary,
           min_margin: float) -> list[dict[str, Any]]:
    pairs = []
    margins, chosen_scores, rejected_scores = [], [], []
    for item in items:
        scored: list[tuple[int, float, dict[str, float]]] = []
        for r, resp in enumerate(item.responses):
            if not resp.text.strip():
                continue
            by_aspect = {}
            for aspect in aspects:
                rec = journal.records.get(judgement_key(aspect, item.prompt, resp.text))
                if rec is not None:
                    by_aspect[aspect] = float(rec["score"])
            if len(by_aspect) < len(aspects):
                summary.responses_unscored += 1
                continue
            scored.append((r, sum(by_aspect.values()) / len(by_aspect), by_aspect))
        if len(scored) < 2:
            summary.prompts_too_few_scored += 1
            continue
        scores = [s for _, s, _ in scored]
        pick = maxmin(scores, min_margin)
        if pick is None:
            summary.prompts_tied += 1
            continue
        best, worst = pick
        summary.best_shared += scores.count(scores[best]) > 1
        summary.worst_shared += scores.count(scores[worst]) > 1
        (cr, cs, ca), (rr, rs, ra) = scored[best], scored[worst]
        pairs.append({"id": item.id, "prompt": [dict(m) for m in item.prompt],
                      "chosen": item.responses[cr].text, "rejected": item.responses[rr].text,
                      "chosen_model": item.responses[cr].model, "rejected_model": item.responses[rr].model,
                      "chosen_score": cs, "rejected_score": rs, "margin": cs - rs,
                      "chosen_aspects": ca, "rejected_aspects": ra})
        margins.append(cs - rs)
        chosen_scores.append(cs)
        rejected_scores.append(rs)
    summary.pairs = len(pairs)
    if pairs:
        summary.margin_mean = sum(margins) / len(margins)
        summary.chosen_score_mean = sum(chosen_scores) / len(chosen_scores)
        summary.rejected_score_mean = sum(rejected_scores) / len(rejected_scores)
    return pairs
