"""``apertus eval report``: run a suite of the report's benchmarks against a served model and write
the report's tables with our numbers beside the report's.

The plan is the suite's Apertus tasks (:mod:`eval_tasks.catalogue`) in the modes the suite runs
(thinking off, on, the base model). Before anything runs, the server is asked what it serves
(:mod:`eval_tasks.report.server`) and every task's needs are checked: the context the protocol's
budgets and RULER's lengths take, the audio length of the long-form tasks, a tokenizer, a judge (named
and answering: asked once for its models), permission to execute model-written code; what is unmet
is listed at once with the option to change (``--skip-unmet`` runs the rest). The tasks then run in one worker process per harness
(:mod:`eval_tasks.report.worker`), with a progress bar over the tasks; each finished task leaves
``runs/<task>/result.json``, and a rerun of the same command skips those (``--rerun`` runs them
again): a killed run resumes where it stopped. Last, ``report.md``, ``report.svg``, ``report.html``,
``report.txt`` (the terminal summary, also printed to stderr) and ``report.json`` are written from every
result in the folder (:mod:`eval_tasks.report.render`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from apertus_plugins.infra.files import write_text_atomic
from eval_tasks.catalogue import (
    CHARTER_ENV,
    JUDGE_KEY_ENV,
    JUDGE_MODEL_ENV,
    JUDGE_URL_ENV,
    SUITES,
    Benchmark,
    by_id,
    load,
    suite,
)

from .render import Line, html, markdown, part_of, svg, terminal
from .worker import write_json

__all__ = ["DEFAULT_LENGTHS", "Item", "Options", "ReportError", "SUITE_MODES", "plan", "run"]

#: The modes each suite runs: thinking off, on, the base model.
SUITE_MODES: dict[str, tuple[str, ...]] = {
    "post-trained-text": ("off",), "thinking": ("think",), "base": ("base",), "image": ("off", "think"),
    "audio": ("off",), "long-context": ("off",), "smoke": ("off",), "all": ("off", "think", "base"),
}
def _report_lengths() -> tuple[int, ...]:
    """RULER's lengths in the report (Table 36): the lengths of the catalogue's RULER rows."""
    return tuple(int(str(row.metric).split(",")[0]) for row in by_id()["ruler"].rows)


#: RULER's lengths in the report (Table 36), 8k to 256k tokens.
DEFAULT_LENGTHS = _report_lengths()
#: RULER's output budget (lm-eval's tasks: 128 new tokens).
RULER_NEW_TOKENS = 128
#: The settings that make two runs' results comparable (a resumed run must match them).
_RUN_KEYS = ("base_url", "model", "limit", "max_new_tokens", "lengths", "tokenizer")


class ReportError(ValueError):
    """The run cannot start as asked; the message says what to change."""


@dataclass
class Options:
    suite: str
    base_url: str
    output: Path
    model: str | None = None
    limit: int | None = None
    tokenizer: str | None = None
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    max_new_tokens: int | None = None
    num_concurrent: int = 1
    timeout: float = 600.0
    allow_code_execution: bool = False
    skip_unmet: bool = False
    rerun: bool = False
    python: str = field(default_factory=lambda: sys.executable)
    progress: bool = True


@dataclass
class Item:
    """One task of the plan: a benchmark in one mode."""

    benchmark: Benchmark
    mode: str
    task: str

    @property
    def harness(self) -> str:
        return str(self.benchmark.harness)


def plan(suite_name: str, only: Sequence[str] = ()) -> list[Item]:
    """The suite's tasks in the modes it runs (``only``: benchmark ids to keep)."""
    if suite_name not in SUITES:
        raise ReportError(f"unknown suite {suite_name!r}; known: {', '.join(SUITES)}")
    known = {b.id: b for b in load()}
    unknown = [x for x in only if x not in known]
    if unknown:
        raise ReportError(f"unknown benchmark(s) {', '.join(unknown)}; `apertus eval benchmarks` lists them")
    absent = [x for x in only if not known[x].runnable]
    if absent:
        raise ReportError("no Apertus task for " + "; ".join(f"{x} ({known[x].absent})" for x in absent))
    chosen = [b for b in suite(suite_name) if not only or b.id in only]
    if only and not chosen:
        raise ReportError(f"none of {', '.join(only)} is in the suite {suite_name}")
    return [Item(b, mode, task) for b in chosen for mode, task in b.tasks.items() if mode in SUITE_MODES[suite_name]]


# ---------------------------------------------------------------------------------------------- checks

def _client(base_url: str, timeout: float = 120.0) -> Any:
    from apertus_plugins.infra.client import Client, RetryPolicy

    return Client(base_url, timeout=timeout, retry=RetryPolicy(attempts=2))


def judge_problem(url: str, model: str) -> str | None:
    """Why the judge the user names cannot serve (unreachable, another model, not a URL), or None."""
    from apertus_plugins.posttrain.judges import JudgeError, OpenAIJudge

    try:
        OpenAIJudge(base_url=url, model=model, feedback_template="{prompt}", rating_template="{prompt}",
                    pairwise_template="{prompt}", api_key=os.environ.get(JUDGE_KEY_ENV, "").strip() or None,
                    timeout=30.0, max_retries=1, backoff=0.5).check()
    except (JudgeError, ValueError) as exc:
        return f"the judge given by {JUDGE_URL_ENV}={url} ({JUDGE_MODEL_ENV}={model}) cannot be used: {exc}"
    return None


def needs(items: Sequence[Item], opts: Options, served: Any, client: Any) -> dict[str, list[str]]:
    """What each task needs that is not there: ``{task: [problem, ...]}`` (the option to change named)."""
    from apertus_plugins.core.media.audio import SAMPLE_RATE, audio_code_count
    from apertus_plugins.posttrain.evaluation import AUDIO_DEFAULT_MAX_TOKENS, DEFAULT_DECODING, THINKING_DECODING

    ctx = served.max_model_len
    out: dict[str, list[str]] = {}
    judges: dict[tuple[str, str], str | None] = {}
    audio_limits: dict[float, str | None] = {}
    for item in items:
        b, problems = item.benchmark, []
        if b.need("tokenizer", item.mode) is not None and not opts.tokenizer:
            problems.append("needs the model's tokenizer: --tokenizer (the checkpoint folder or its Hub id)")
        if b.need("unsafe_code") is not None and not opts.allow_code_execution:
            problems.append("executes the model's code to score it: --allow-code-execution")
        wanted = [*((JUDGE_URL_ENV, JUDGE_MODEL_ENV) if b.need("judge") is not None else ()),
                  *((CHARTER_ENV,) if b.need("charter") is not None else ())]
        unset = [v for v in wanted if not os.environ.get(v, "").strip()]
        if unset:
            problems.append(f"needs a judge: set {', '.join(unset)}" + (
                f" (the report's judge: {b.report_judge})" if b.need("judge") is not None else ""))
        if b.need("judge") is not None and not {JUDGE_URL_ENV, JUDGE_MODEL_ENV} & set(unset):
            url, model = os.environ[JUDGE_URL_ENV].strip(), os.environ[JUDGE_MODEL_ENV].strip()
            if (url, model) not in judges:
                judges[(url, model)] = judge_problem(url, model)
            if judges[(url, model)]:
                problems.append(str(judges[(url, model)]))
        if ctx:
            if b.by_length:
                longest = max(opts.lengths)
                if longest + RULER_NEW_TOKENS > ctx:
                    problems.append(f"RULER at {longest} tokens needs a served context of at least "
                                    f"{longest + RULER_NEW_TOKENS}; the server serves {ctx}: serve with "
                                    f"--max-model-len {longest + RULER_NEW_TOKENS} or pass shorter --lengths")
            elif b.harness == "lm_eval" and b.kind_in(item.mode) in ("chat", "handwritten") and not opts.max_new_tokens:
                budget = int((THINKING_DECODING if item.mode == "think" else DEFAULT_DECODING)["max_new_tokens"])
                if budget >= ctx:
                    problems.append(f"the protocol's budget of {budget} new tokens does not fit the served context "
                                    f"of {ctx}: serve a longer --max-model-len, or pass --max-new-tokens (then the "
                                    "numbers are not the protocol's)")
        seconds = b.need("audio_seconds")
        if seconds:
            need_s = float(seconds)
            if need_s not in audio_limits:
                from .server import audio_probe

                root = opts.base_url[: -len("/v1")] if opts.base_url.endswith("/v1") else opts.base_url
                audio_limits[need_s] = audio_probe(client, root, served.name, need_s)
            if audio_limits[need_s] is not None:
                problems.append(str(audio_limits[need_s]))
            codes = audio_code_count(int(need_s * SAMPLE_RATE)) + AUDIO_DEFAULT_MAX_TOKENS
            if ctx and codes > ctx:
                problems.append(f"a {need_s:g} s clip and its transcript take about {codes} tokens; the server serves "
                                f"{ctx}: serve with --max-model-len {codes + 512}")
        if problems:
            out[item.task] = problems
    return out


# ---------------------------------------------------------------------------------------------- running

def _finished(opts: Options, task: str) -> bool:
    return (opts.output / "runs" / task / "result.json").is_file()


def _settings(opts: Options, served: Any) -> dict[str, Any]:
    return {"base_url": opts.base_url, "model": served.name, "limit": opts.limit, "max_new_tokens": opts.max_new_tokens,
            "lengths": list(opts.lengths), "tokenizer": opts.tokenizer}


def _check_resume(opts: Options, settings: dict[str, Any]) -> None:
    path = opts.output / "run.json"
    if path.is_file() and not opts.rerun:
        before = json.loads(path.read_text(encoding="utf-8"))
        differ = [k for k in _RUN_KEYS if before.get(k) != settings.get(k)]
        if differ:
            raise ReportError(f"{opts.output} holds results of a run with other settings ("
                              + ", ".join(f"{k}: {before.get(k)!r} then, {settings.get(k)!r} now" for k in differ)
                              + "); use another --output, or --rerun to replace them")
    write_json(path, settings)


def _worker(opts: Options, harness: str, items: list[Item], served: Any, include: Path, log: Any,
            bar: Any) -> dict[str, str]:
    """Run ``items`` of one harness in worker processes; returns ``{task: error}`` of the failed ones."""
    failed: dict[str, str] = {}
    pending = list(items)
    while pending:
        events = opts.output / f".events-{harness}-{os.getpid()}-{time.time_ns()}.jsonl"
        spec = {"harness": harness, "include_path": str(include), "events": str(events), "base_url": opts.base_url,
                "model": served.name, "limit": opts.limit, "num_concurrent": opts.num_concurrent,
                "timeout": opts.timeout, "max_new_tokens": opts.max_new_tokens, "tokenizer": opts.tokenizer,
                "lengths": list(opts.lengths), "allow_code_execution": opts.allow_code_execution,
                "tasks": [{"task": i.task, "kind": i.benchmark.kind_in(i.mode), "chat": i.benchmark.chat_in(i.mode),
                           "multi_turn": i.benchmark.multi_turn_in(i.mode), "dir": str(opts.output / "runs" / i.task)}
                          for i in pending]}
        plan_path = events.with_suffix(".plan.json")
        write_json(plan_path, spec)
        proc = subprocess.Popen([opts.python, "-m", "eval_tasks.report.worker", str(plan_path)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        started: str | None = None
        seen = 0
        try:
            while True:
                done = proc.poll() is not None
                lines = events.read_text(encoding="utf-8").splitlines() if events.is_file() else []
                for line in lines[seen:]:
                    event = json.loads(line)
                    if event["event"] == "start":
                        started = event["task"]
                        bar.set_postfix_str(started)
                    else:
                        started = None
                        pending = [i for i in pending if i.task != event["task"]]
                        if not event.get("ok"):
                            failed[event["task"]] = event.get("error", "failed")
                        bar.update(1)
                seen = len(lines)
                if done:
                    break
                time.sleep(0.5)
        except BaseException:
            _stop(proc)
            raise
        finally:
            plan_path.unlink(missing_ok=True)
            events.unlink(missing_ok=True)
        if pending and seen == 0:  # the worker died before its first task: none of the others would run either
            for item in pending:
                failed[item.task] = f"the {harness} worker exited with status {proc.returncode} before its first task " \
                                    f"(see {log.name})"
            bar.update(len(pending))
            break
        if pending:  # the worker died on a task: that one failed, the others go to a new worker
            crashed = started or pending[0].task
            failed[crashed] = f"the {harness} worker exited with status {proc.returncode} (see {log.name})"
            pending = [i for i in pending if i.task != crashed]
            bar.update(1)
    return failed


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


# ---------------------------------------------------------------------------------------------- results

def _value(result: dict[str, Any], task: str, metric: str) -> float | None:
    for section in ("results", "groups"):
        found = ((result.get(section) or {}).get(task) or {}).get(metric)
        if isinstance(found, (int, float)) and not isinstance(found, bool):
            return float(found)
    return None


#: The suite that holds each part of the report whole: a run of it lists the part's absent benchmarks too.
_PART_SUITE = {"text": "post-trained-text", "thinking": "thinking", "base": "base", "image": "image",
               "image-thinking": "image", "audio": "audio", "long-context": "long-context"}


def _length_rows(b: Benchmark, lengths: Sequence[int]) -> list[Any]:
    """A long-context benchmark's rows: the report's lengths, and the run's lengths the report has not."""
    from eval_tasks.catalogue import Row

    rows = list(b.rows)
    known = {r.metric.split(",")[0] for r in rows if r.metric}
    stem = rows[0].label.rsplit(" ", 1)[0]
    for n in lengths:
        if str(n) not in known:
            rows.append(Row(f"{stem} {n // 1024}k" if n % 1024 == 0 else f"{stem} {n}", f"{n},none", {}))
    return rows


def lines(opts: Options, suite_name: str, items: Sequence[Item], skipped: dict[str, list[str]],
          failed: dict[str, str], only: Sequence[str] = ()) -> list[Line]:
    """The written tables' rows: every benchmark row the run planned, and the absent benchmarks of each
    part of the report the suite holds whole."""
    planned = {(i.benchmark.id, i.mode): i for i in items}
    whole = {part for part, name in _PART_SUITE.items() if not only and suite_name in (name, "all")}
    out: list[Line] = []
    for b in load():
        for mode in ("off", "think", "base"):
            item = planned.get((b.id, mode))
            if item is None and (b.runnable or part_of(b, mode) not in whole
                                 or not any(r.reference.get(mode) for r in b.rows)):
                continue
            by_length = b.by_length and item is not None
            for row in (_length_rows(b, opts.lengths) if by_length else b.rows):
                ref = row.reference.get(mode)
                if item is None:
                    out.append(Line(b, row.label, mode, None, None, None, f"absent: {b.absent}", ref))
                    continue
                status, ours = "ok", None
                result_path = opts.output / "runs" / item.task / "result.json"
                if item.task in skipped:
                    status = "skipped: " + "; ".join(skipped[item.task])
                elif item.task in failed:
                    status = f"failed: {failed[item.task]}"
                elif not result_path.is_file():
                    status = "not run"
                else:
                    result = json.loads(result_path.read_text(encoding="utf-8"))
                    value = _value(result, item.task, str(row.metric))
                    if by_length and (value is None or value < 0):
                        status = "not run at this length (--lengths)"
                    elif value is None:
                        status = f"no {row.metric} in the results"
                    else:
                        ours = value * b.scale
                out.append(Line(b, row.label, mode, item.task, row.metric, ours, status, ref))
    return out


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("lm-eval", "lmms-eval", "apertus-plugins"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def run(opts: Options, only: Sequence[str] = ()) -> Path:
    """Run the suite (resuming) and write the report; returns the path of ``report.md``."""
    from tqdm import tqdm

    from eval_tasks.derive import include_path

    from .server import served_model

    items = plan(opts.suite, only)
    opts.output.mkdir(parents=True, exist_ok=True)
    with _client(opts.base_url) as client:
        served = served_model(client, opts.base_url, opts.model)
        problems = needs(items, opts, served, client)
    if problems and not opts.skip_unmet:
        listed = "\n".join(f"  {task}: " + "; ".join(p) for task, p in problems.items())
        raise ReportError(f"{len(problems)} task(s) cannot run against {opts.base_url} ({served.name}, context "
                          f"{served.max_model_len}):\n{listed}\n(--skip-unmet runs the others)")
    _check_resume(opts, _settings(opts, served))
    for stale in opts.output.glob(".events-*"):  # a killed run's progress files
        stale.unlink(missing_ok=True)
    todo = [i for i in items if i.task not in problems and (opts.rerun or not _finished(opts, i.task))]
    failed: dict[str, str] = {}
    with tqdm(total=len(items), initial=len(items) - len(todo), desc=f"apertus eval report {opts.suite}", unit="task",
              disable=not opts.progress, file=sys.stderr) as bar:
        for harness in ("lm_eval", "lmms_eval"):
            batch = [i for i in todo if i.harness == harness]
            if not batch:
                continue
            bar.set_postfix_str(f"preparing {harness} tasks")
            include = include_path(harness)
            with open(opts.output / f"{harness}.log", "a", encoding="utf-8") as log:
                failed.update(_worker(opts, harness, batch, served, include, log, bar))
    table = lines(opts, opts.suite, items, problems, failed, only)
    header = {"model": f"{served.name} at {opts.base_url} (served context {served.max_model_len})",
              "suite": f"{opts.suite}: {SUITES[opts.suite]}" + (f" (benchmarks {', '.join(only)})" if only else ""),
              "limit": f"{opts.limit} items per task" if opts.limit else "none (the full benchmarks)",
              "tasks": f"{len(items)} planned, {sum(_finished(opts, i.task) for i in items)} with results, "
                       f"{len(failed)} failed, {len(problems)} skipped",
              "harnesses": ", ".join(f"{k} {v}" for k, v in _versions().items()),
              "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    report = opts.output / "report.md"
    title = f"Apertus 1.5 ({served.name}) vs the report: {opts.suite}"
    for path, text in ((report, markdown(table, header)), (opts.output / "report.svg", svg(table, title)),
                       (opts.output / "report.html", html(table, title, header)),
                       (opts.output / "report.txt", terminal(table, color=False))):
        write_text_atomic(path, text)
    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    print(terminal(table, color=color), file=sys.stderr)
    write_json(opts.output / "report.json", {"header": header, "rows": [
        {**{k: v for k, v in asdict(line).items() if k not in ("benchmark", "reference")}, "benchmark": line.benchmark.id,
         "reference": asdict(line.reference) if line.reference else None, "delta": line.delta,
         "protocol": line.protocol, "cited": line.cited} for line in table]})
    return report
