"""The report's benchmarks as data: every benchmark of the Apertus 1.5 report's evaluation tables,
its setting, the upstream task the Apertus variant derives from (or why it has none) and the
report's numbers for the released 8B, each cited by table, row and column.

The data is ``catalogue.yaml`` beside this module; this module reads and checks it. It is the one
place that names the report's benchmarks: the task generator (:mod:`eval_tasks.derive`), the
``apertus eval report`` command and the benchmark table of the documentation all read it.

Entry fields (``catalogue.yaml``):

- ``id``, ``name``: a unique key and the report's name of the benchmark;
- ``listed``: where the report lists it (``L.1 Math``, ``Table 34``...); ``setting``: the
  report's row as printed (metric, type, CoT, shots, chat, multi-turn, languages);
- ``suites``: the ``apertus eval report`` suites that run it;
- ``harness`` (``lm_eval``, ``lmms_eval``) and ``kind``: ``chat`` (generated through the chat
  template under the protocol), ``completions`` (log-likelihood scoring through the completions
  API, with the chat template when the row says so), ``base`` (the base-model row: upstream's
  own prompt and decoding through the completions API), ``handwritten`` (a task of this package,
  where upstream has none) or ``lmms`` (an lmms-eval task through the ``apertus`` model);
- ``upstream`` and ``upstream_dir``: the upstream task, group or tag (or a list of them, made one
  group) and the folder(s) (under the harness's ``tasks/``) that hold it and its members; ``task``:
  the Apertus task (default ``apertus_<upstream>``); ``template``: the YAML of a hand-written task (under the harness's
  folder of this package): a ``handwritten`` row's lm-eval task, or an ``lmms`` row's own lmms-eval task where
  lmms-eval has none (then no ``upstream``; VQA-RAD);
- ``metric``: the result key the report reads (``exact_match,strict-match``); ``scale``: the
  factor to percent (100 for a fraction, 1 for a harness that reports percent); ``higher_is_better``;
- ``think``: a thinking variant ``<task>_think`` too: ``true`` (one run) or a key of
  :data:`apertus_plugins.posttrain.evaluation.MEAN_AT_K` (mean@k over sampled runs);
- ``multi_turn``: few-shot examples as earlier turns; ``num_fewshot``: the report's shots where
  upstream's differ; ``chat``: the chat template for a ``completions`` row;
- ``data``: the local-data key (``APERTUS_EVAL_DATA_<KEY>``) and, for lmms-eval, the image and
  audio columns; ``overrides``: config keys replaced in the derived task (``!function x.y`` text
  for a function); ``add_filters``: filter pipelines added beside upstream's (lmms-eval);
- ``needs``: what a run needs beyond the served model: ``tokenizer``, ``unsafe_code``,
  ``judge`` (a judge the user names: ``APERTUS_EVAL_JUDGE_URL``, ``APERTUS_EVAL_JUDGE_MODEL``),
  ``charter`` (the charter the judge reads: ``APERTUS_EVAL_CHARTER``), ``tools`` (the tool-call
  stops), ``audio_seconds:N`` (clips of up to N seconds);
- ``absent``: why the benchmark has no Apertus task (then no harness fields); ``subtask_of``: the
  benchmark of the report an entry is a part of (not counted as one of the report's);
- ``reference``: the report's numbers for the released 8B: ``off`` (thinking off), ``think``,
  ``base`` (the released base model): ``[value, table, row, column]``, optionally with a fifth
  item ``{unlike: why}`` where the report has no number for what this package runs (the row then
  shows ours with the reason and no difference); ``reference_70b``: the same for the 70B (shown,
  not compared: this package's suites compare the 8B); ``rows``: several rows of one task
  (RULER's lengths), each ``{label, metric, reference}``;
- ``base_run``: the benchmark also runs on the base model (a ``<task>_base`` variant: upstream's
  prompt, or a hand-written task's own, without the chat template), for its base-model number of Tables 13-22;
- ``report_judge``: for a row that needs a judge, the judge the report scored with (ours is the
  one the user names), or why it names none;
- ``categories``: the category set this package runs (``all`` unless it runs a part of the benchmark).

Like for like: every cited table has its setting as data (the top-level ``tables`` of
``catalogue.yaml``: the caption's words, the thinking mode, and the metric, shots or category set
the caption fixes for some rows). :func:`cited_protocol` is what the report ran for a number (the
benchmark's row of Tables L.1/L.2 overridden by the cited table's setting), :meth:`Benchmark.protocol`
what this package runs; a reference must pair the two or say ``unlike``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["CHARTER_ENV", "JUDGE_KEY_ENV", "JUDGE_MODEL_ENV", "JUDGE_TOP_ENV", "JUDGE_URL_ENV", "Benchmark", "CatalogueError", "KINDS", "METRIC_NAMES", "Protocol", "Reference", "Row", "SUITES", "Table",
           "benchmarks", "by_id", "cited_protocol", "load", "mismatches", "suite", "tables"]

KINDS = ("chat", "completions", "base", "handwritten", "lmms")
#: The judge a ``needs: judge`` row runs with, named by the user: its ``/v1`` URL, its served model name and,
#: where it needs one, an API key; the charter a ``needs: charter`` row's judge reads.
JUDGE_URL_ENV = "APERTUS_EVAL_JUDGE_URL"
JUDGE_MODEL_ENV = "APERTUS_EVAL_JUDGE_MODEL"
JUDGE_KEY_ENV = "APERTUS_EVAL_JUDGE_API_KEY"
#: the alternatives a pairwise judge's verdict token is read from (its top log-probabilities; default 20)
JUDGE_TOP_ENV = "APERTUS_EVAL_JUDGE_TOP_LOGPROBS"
CHARTER_ENV = "APERTUS_EVAL_CHARTER"
#: The suites of ``apertus eval report`` and what each runs.
SUITES: dict[str, str] = {
    "post-trained-text": "the text benchmarks of Tables L.1 and L.2 on the post-trained model, thinking off",
    "thinking": "the benchmarks the report also runs with thinking on (Tables 25 and 28)",
    "base": "the base-model rows of Tables L.1 and L.2 (Tables 13 to 22), without the chat template: serve the base model",
    "image": "the image benchmarks of Table 34 (section 5.5)",
    "audio": "the audio benchmarks of Table 35 (section 5.6)",
    "long-context": "RULER and HELMET (Table 36, section 5.7)",
    "smoke": "one benchmark of each kind (log-likelihood, chat with shots, long context, image, audio): is it wired?",
    "all": "every suite",
}
_THINK = (True, False, "aime", "math", "code")
_MODES = ("off", "think", "base")
#: The report's metric names (Tables L.1/L.2) of the result keys this package reads (the key before the comma).
METRIC_NAMES: dict[str, str] = {
    "exact_match": "Exact Match", "acc": "Accuracy", "acc_norm": "Accuracy (norm.)", "f1": "F1",
    "math_verify": "Math Verify", "pass@1": "Pass@1", "pass_at_1": "Pass@1",
    "prompt_level_loose_acc": "Accuracy (prompt-level loose)", "prompt_level_strict_acc": "Accuracy (prompt-level strict)",
    "refusal_rate": "Refusal rate", "lc_win_rate": "Length-controlled win rate",
}


class CatalogueError(ValueError):
    """``catalogue.yaml`` is malformed; the message names the entry and the field."""


@dataclass(frozen=True)
class Reference:
    """One number of the report: ``value`` in ``table`` (``L.3``, ``34``...), row and column."""

    value: float
    table: str
    row: str
    column: str
    unlike: str | None = None  # why the report's number is not for what this package runs (no difference shown)

    def cite(self) -> str:
        return f"Table {self.table}, {self.row}, {self.column}"


@dataclass(frozen=True)
class Table:
    """The setting of one table of the report, as data: ``quote`` (words of its caption, checked
    against the report's text by ``tools/check_report_numbers.py``), ``thinking`` (``off``, ``on`` or
    ``base``: the base model) and what the caption fixes for some rows (by benchmark id or by the
    ``listed`` section): ``metric``, ``shots``, ``categories``, ``sampling``."""

    key: str
    quote: str
    thinking: str | dict[str, str]
    metric: dict[str, str] = field(default_factory=dict)
    shots: dict[str, int] = field(default_factory=dict)
    categories: dict[str, str] = field(default_factory=dict)
    sampling: dict[str, str] = field(default_factory=dict)

    def thinking_of(self, column: str) -> str:
        """The thinking mode of a column (``off``, ``on``, ``base``)."""
        if isinstance(self.thinking, str):
            return self.thinking
        if column not in self.thinking:
            raise CatalogueError(f"catalogue.yaml, table {self.key}: no thinking mode for column {column!r}")
        return self.thinking[column]

    def fixes(self, what: str, b: Benchmark) -> Any:
        """What the caption fixes of ``what`` for ``b`` (by id, else by its section), or None."""
        values = getattr(self, what)
        if b.id in values:
            return values[b.id]
        return next((v for k, v in values.items() if b.listed.startswith(k)), None)


@dataclass(frozen=True)
class Protocol:
    """A setting one number is measured under: the metric (the report's name), the shots, the
    category set and the thinking mode (``off``, ``on``, ``base``); None where the table leaves it to
    the task (images, audio, long context)."""

    metric: str | None
    shots: int | None
    categories: str
    thinking: str
    sampling: str | None = None  # mean@k over sampled runs, where a table or the run says so (shown, not compared)

    def describe(self) -> str:
        parts = [self.metric or "the task's metric"]
        if self.shots is not None:
            parts.append(f"{self.shots} shots")
        if self.categories != "all":
            parts.append(f"categories: {self.categories}")
        parts.append({"off": "thinking off", "on": "thinking on", "base": "base model"}[self.thinking])
        if self.sampling:
            parts.append(self.sampling)
        return "; ".join(parts)


@dataclass(frozen=True)
class Row:
    """One row of the report's tables that a benchmark's run fills: its label, the result key, the
    report's numbers by mode (``off``, ``think``, ``base``)."""

    label: str
    metric: str | None
    reference: dict[str, Reference]


@dataclass(frozen=True)
class Benchmark:
    """One benchmark of the report (see the module docstring for the fields)."""

    id: str
    name: str
    listed: str
    setting: str
    suites: tuple[str, ...] = ()
    harness: str | None = None
    kind: str | None = None
    upstream: str | tuple[str, ...] | None = None
    upstream_dir: str | tuple[str, ...] | None = None
    task: str | None = None
    template: str | None = None
    metric: str | None = None
    scale: float = 100.0
    higher_is_better: bool = True
    think: bool | str = False
    multi_turn: bool = False
    chat: bool = True
    num_fewshot: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    add_filters: tuple[dict[str, Any], ...] = ()
    needs: tuple[str, ...] = ()
    absent: str | None = None
    rows: tuple[Row, ...] = ()
    note: str | None = None
    subtask_of: str | None = None  # not a benchmark of the report's tables: a part of one (RULER's NIAH)
    base_run: bool = False
    categories: str = "all"
    report_judge: str | None = None  # the judge the report scored with (a ``judge`` row names it; ours is the user's)
    reference_70b: dict[str, Reference] = field(default_factory=dict)

    @property
    def runnable(self) -> bool:
        return self.absent is None

    @property
    def tasks(self) -> dict[str, str]:
        """The Apertus tasks of this benchmark by mode: ``off`` (or ``base``) and ``think``."""
        if not self.runnable:
            return {}
        out = {"base" if self.kind == "base" or (self.kind == "completions" and not self.chat) else "off": self.task}
        if self.think:
            out["think"] = f"{self.task}_think"
        if self.base_run:
            out["base"] = f"{self.task}_base"
        return out

    def suffix(self, mode: str) -> str:
        """The suffix of the task of ``mode`` after the benchmark's task name."""
        return "_think" if mode == "think" else "_base" if mode == "base" and self.base_run else ""

    def kind_in(self, mode: str) -> str:
        """How the task of ``mode`` runs: a base-model variant of a generated or hand-written benchmark is
        ``base`` (upstream's or the task's own prompt, the base decoding, through the completions API)."""
        if mode == "base" and self.base_run and self.kind in ("chat", "handwritten"):
            return "base"
        return str(self.kind)

    def chat_in(self, mode: str) -> bool:
        """Whether the task of ``mode`` goes through the chat template (never on the base model)."""
        return self.chat and mode != "base"

    def multi_turn_in(self, mode: str) -> bool:
        return self.multi_turn and self.chat_in(mode)

    def needs_in(self, mode: str) -> tuple[str, ...]:
        """What the task of ``mode`` needs: a base-model variant reads log-likelihoods or completions
        through the model's tokenizer."""
        if mode == "base" and self.base_run and "tokenizer" not in self.needs:
            return ("tokenizer", *self.needs)
        return self.needs

    def protocol(self, mode: str, shots: int | None = None) -> Protocol:
        """What this package runs in ``mode``: the report's name of the metric read, the shots
        (``shots``: the derived task's, where known; else the catalogue's), the category set."""
        key = str(self.rows[0].metric or "").split(",")[0]
        metric = METRIC_NAMES.get(key)
        if shots is None:
            shots = self.num_fewshot if self.num_fewshot is not None else _shots(self.setting)
        sampling = f"mean@{self.repeats}" if mode == "think" and self.repeats > 1 else None
        return Protocol(metric, shots, self.categories, {"think": "on"}.get(mode, mode), sampling)

    @property
    def by_length(self) -> bool:
        """Scored per prompt length (RULER: the metrics are lengths in tokens, ``8192,none``)."""
        return all(r.metric and r.metric.split(",")[0].isdigit() for r in self.rows)

    @property
    def repeats(self) -> int:
        """Sampled runs of the thinking variant (mean@k), 1 without."""
        from apertus_plugins.posttrain.evaluation import MEAN_AT_K

        return MEAN_AT_K[self.think] if isinstance(self.think, str) else 1

    def need(self, prefix: str, mode: str | None = None) -> str | None:
        """The value of a ``needs`` item ``prefix:value`` (``""`` for a bare ``prefix``), None if not needed."""
        for item in (self.needs if mode is None else self.needs_in(mode)):
            name, _, value = item.partition(":")
            if name == prefix:
                return value
        return None


def _fail(entry: Any, msg: str) -> CatalogueError:
    name = entry.get("id") if isinstance(entry, dict) else entry
    return CatalogueError(f"catalogue.yaml, benchmark {name!r}: {msg}")


def _reference(entry: dict[str, Any], raw: Any) -> dict[str, Reference]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) - set(_MODES):
        raise _fail(entry, f"reference must map {'/'.join(_MODES)} to [value, table, row, column], got {raw!r}")
    out = {}
    for mode, cite in raw.items():
        extra: dict[str, Any] = {}
        if isinstance(cite, list) and len(cite) == 5 and isinstance(cite[4], dict):
            extra, cite = cite[4], cite[:4]
            if set(extra) != {"unlike"} or not isinstance(extra["unlike"], str) or not extra["unlike"]:
                raise _fail(entry, f"reference {mode}: the fifth item is {{unlike: why}}, got {extra!r}")
        if not (isinstance(cite, list) and len(cite) == 4 and isinstance(cite[0], (int, float))
                and all(isinstance(c, str) and c for c in cite[1:])):
            raise _fail(entry, f"reference {mode}: expected [value, table, row, column], got {cite!r}")
        out[mode] = Reference(float(cite[0]), *cite[1:], unlike=extra.get("unlike"))
    return out


#: The metric names of Tables L.1 and L.2 (the first item of a benchmark's ``setting``).
REPORT_METRICS = ("Exact Match", "Accuracy (prompt-level loose)", "Accuracy (prompt-level strict)", "Accuracy (norm.)",
                  "Accuracy", "F1", "Math Verify", "Pass@10", "Pass@1", "Refusal rate", "Length-controlled win rate",
                  "Arena-Hard score", "Score", "Hallucination rate", "Precision", "Abstention rate", "Pass rate")


def _setting_metric(setting: str) -> str | None:
    first = setting.split(";")[0].strip()
    return first if first in REPORT_METRICS else None


def _shots(setting: str) -> int | None:
    found = re.search(r"\b(\d+) shots\b", setting)
    return int(found.group(1)) if found else None


def cited_protocol(b: Benchmark, ref: Reference) -> Protocol:
    """What the report ran for ``ref``: the benchmark's row of Tables L.1/L.2 (its ``setting``: metric
    and shots), overridden where the cited table's caption fixes them, in the table's thinking mode."""
    table = tables().get(ref.table)
    if table is None:
        raise CatalogueError(f"catalogue.yaml, benchmark {b.id!r}: Table {ref.table} has no setting under 'tables'")
    metric = table.fixes("metric", b) or _setting_metric(b.setting)
    shots = table.fixes("shots", b)
    thinking = table.thinking_of(ref.column)
    return Protocol(metric, _shots(b.setting) if shots is None else int(shots), table.fixes("categories", b) or "all",
                    thinking, table.fixes("sampling", b) if thinking == "on" else None)


def mismatches(b: Benchmark, mode: str, ref: Reference, shots: int | None = None) -> list[str]:
    """How what this package runs in ``mode`` differs from what the report ran for ``ref`` (empty: like
    for like). ``shots``: the derived task's, where known. The metric and the shots are compared where
    both name one (the image, audio and long-context tables leave them to the task)."""
    ours, theirs = b.protocol(mode, shots), cited_protocol(b, ref)
    out = []
    if ours.metric and theirs.metric and ours.metric != theirs.metric:
        out.append(f"metric: the report's {theirs.metric}, ours {ours.metric}")
    if ours.shots is not None and theirs.shots is not None and ours.shots != theirs.shots:
        out.append(f"shots: the report's {theirs.shots}, ours {ours.shots}")
    if ours.categories != theirs.categories:
        out.append(f"categories: the report's {theirs.categories}, ours {ours.categories}")
    if ours.thinking != theirs.thinking:
        out.append(f"thinking: the report's {theirs.thinking}, ours {ours.thinking}")
    return out


_FIELDS = {f for f in Benchmark.__dataclass_fields__} | {"reference"}
_TABLE_FIELDS = {"quote", "thinking", "metric", "shots", "categories", "sampling"}


def _benchmark(entry: dict[str, Any]) -> Benchmark:
    unknown = set(entry) - _FIELDS
    if unknown:
        raise _fail(entry, f"unknown fields {sorted(unknown)}")
    for key in ("id", "name", "listed", "setting"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise _fail(entry, f"{key} is required")
    if not re.fullmatch(r"[a-z0-9_]+", entry["id"]):
        raise _fail(entry, "id must be lower-case letters, digits and underscores")
    kw = dict(entry)
    reference = _reference(entry, kw.pop("reference", None))
    rows = tuple(Row(r["label"], r.get("metric"), _reference(entry, r.get("reference"))) for r in kw.pop("rows", []))
    kw["rows"] = rows or (Row(entry["name"], entry.get("metric"), reference),)
    kw["reference_70b"] = _reference(entry, kw.get("reference_70b"))
    if kw.get("base_run") and not (kw.get("kind") in ("chat", "completions", "handwritten") and kw.get("chat", True)):
        raise _fail(entry, "base_run adds a base-model variant to a benchmark run through the chat template")
    for key in ("suites", "needs", "add_filters"):
        kw[key] = tuple(kw.get(key) or ())
    for key in ("upstream", "upstream_dir"):
        if isinstance(kw.get(key), list):
            kw[key] = tuple(kw[key])
    bad = set(kw["suites"]) - set(SUITES)
    if bad:
        raise _fail(entry, f"unknown suites {sorted(bad)}; known: {', '.join(SUITES)}")
    if "judge" in kw["needs"] and not kw.get("report_judge"):
        raise _fail(entry, "a row that needs a judge names the report's (report_judge), or says why it names none")
    if kw.get("think", False) not in _THINK:
        raise _fail(entry, f"think must be one of {_THINK}")
    if entry.get("absent"):
        extra = {"harness", "kind", "upstream", "task", "template", "suites"} & set(entry)
        if extra:
            raise _fail(entry, f"an absent benchmark has no {sorted(extra)}")
        return Benchmark(**kw)
    if kw.get("kind") not in KINDS:
        raise _fail(entry, f"kind must be one of {KINDS}")
    harness = "lmms_eval" if kw["kind"] == "lmms" else "lm_eval"
    if kw.get("harness", harness) != harness:
        raise _fail(entry, f"kind {kw['kind']} runs on {harness}")
    kw["harness"] = harness
    if kw["kind"] == "handwritten" or (kw["kind"] == "lmms" and kw.get("template")):
        if not kw.get("template") or not kw.get("task"):
            raise _fail(entry, "a hand-written task names its template and task")
        if kw.get("upstream"):
            raise _fail(entry, "a task of this package (template) derives from no upstream task: drop upstream")
    elif not kw.get("upstream"):
        raise _fail(entry, "upstream is required (or absent: the reason)")
    if isinstance(kw.get("upstream"), tuple) and not kw.get("task"):
        raise _fail(entry, "several upstream tasks make one group: name it (task)")
    kw.setdefault("task", f"apertus_{kw.get('upstream')}")
    if not str(kw["task"]).startswith("apertus_"):
        raise _fail(entry, "the Apertus task's name starts with apertus_")
    if not kw["suites"]:
        raise _fail(entry, "a runnable benchmark belongs to a suite")
    if any(r.metric is None for r in kw["rows"]):
        raise _fail(entry, "metric is required (the result key the report reads)")
    return Benchmark(**kw)


def _loader() -> type:
    """YAML 1.2 booleans: ``off`` is the name of a mode here, not False."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    bool_tag = "tag:yaml.org,2002:bool"
    Loader.yaml_implicit_resolvers = {k: [(t, rx) for t, rx in v if t != bool_tag]
                                      for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return Loader


@cache
def _raw() -> dict[str, Any]:
    import yaml

    text = (resources.files("eval_tasks") / "catalogue.yaml").read_text(encoding="utf-8")
    raw = yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader with YAML 1.2 booleans
    if not isinstance(raw, dict) or not isinstance(raw.get("benchmarks"), list):
        raise CatalogueError("catalogue.yaml: expected a mapping with a 'benchmarks' list")
    return raw


@cache
def tables() -> dict[str, Table]:
    """The setting of every cited table (``catalogue.yaml``'s ``tables``), by the table's key."""
    raw = _raw().get("tables")
    if not isinstance(raw, dict):
        raise CatalogueError("catalogue.yaml: expected a 'tables' mapping (the setting of each cited table)")
    out = {}
    for key, entry in raw.items():
        key = str(key)
        if not isinstance(entry, dict) or set(entry) - _TABLE_FIELDS or not entry.get("quote"):
            raise CatalogueError(f"catalogue.yaml, table {key}: expected {{quote, thinking, ...}} with fields "
                                 f"{sorted(_TABLE_FIELDS)}, got {entry!r}")
        thinking = entry.get("thinking")
        modes = list(thinking.values()) if isinstance(thinking, dict) else [thinking]
        if not modes or any(m not in ("off", "on", "base") for m in modes):
            raise CatalogueError(f"catalogue.yaml, table {key}: thinking is off, on or base (or one per column)")
        out[key] = Table(key, str(entry["quote"]), thinking,
                         **{k: dict(entry.get(k) or {}) for k in ("metric", "shots", "categories", "sampling")})
    return out


@cache
def load() -> tuple[Benchmark, ...]:
    """Every benchmark of ``catalogue.yaml``, checked."""
    raw = _raw()
    out = tuple(_benchmark(e) for e in raw["benchmarks"])
    seen: dict[str, str] = {}
    for b in out:
        for key in (b.id, *b.tasks.values()):
            if key in seen and seen[key] != b.id:
                raise CatalogueError(f"catalogue.yaml: {key!r} is used by {seen[key]!r} and {b.id!r}")
            seen[key] = b.id
        if b.id in seen and seen[b.id] != b.id:
            raise CatalogueError(f"catalogue.yaml: duplicate id {b.id!r}")
    if len({b.id for b in out}) != len(out):
        raise CatalogueError("catalogue.yaml: duplicate ids")
    known = tables()
    for b in out:
        for ref in [r for row in b.rows for r in row.reference.values()] + list(b.reference_70b.values()):
            if ref.table not in known:
                raise CatalogueError(f"catalogue.yaml, benchmark {b.id!r}: Table {ref.table} has no setting under "
                                     "'tables'")
            known[ref.table].thinking_of(ref.column)
    return out


def benchmarks() -> tuple[Benchmark, ...]:
    return load()


def by_id() -> dict[str, Benchmark]:
    return {b.id: b for b in load()}


def suite(name: str) -> list[Benchmark]:
    """The runnable benchmarks of a suite (``all``: every runnable one)."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return [b for b in load() if b.runnable and (name == "all" or name in b.suites)]
