"""The written report: Markdown tables with our numbers beside the report's, and a picture.

- :func:`markdown`: one table per part of the report (text with thinking off and on, the base
  model, images, audio, long context): the benchmark, our number, the report's number for the
  released 8B and the difference, the Apertus task and the metric read, and where the report's
  number stands (table, row, column); a benchmark without an Apertus task is listed with why.
- :func:`svg`: bars per benchmark, ours beside the report's, written as SVG text directly (no
  plotting library: the picture is a few rectangles and labels, deterministic byte for byte).
- :func:`benchmark_table`: the catalogue as the documentation's table (every benchmark of the
  report, the upstream task, the Apertus task and settings, or why it is absent), with counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from eval_tasks.catalogue import Benchmark, load

__all__ = ["Line", "PARTS", "benchmark_table", "counts", "markdown", "part_of", "svg"]

#: The parts of the report's tables, in order: (key, title, the catalogue's ``listed`` prefixes, mode).
PARTS: list[tuple[str, str, tuple[str, ...], str]] = [
    ("text", "Text, thinking off (Tables L.1-L.3, 23, 27)", ("L.1", "L.2", "Tables 23"), "off"),
    ("thinking", "Text, thinking on (Tables 25, 28)", ("L.1", "L.2", "Tables 23"), "think"),
    ("base", "Base model (Tables 13-22)", ("L.1", "L.2"), "base"),
    ("image", "Images, thinking off (Table 34, 8B)", ("Table 34",), "off"),
    ("image-thinking", "Images, thinking on (Table 34, 8Bth)", ("Table 34",), "think"),
    ("audio", "Audio (Table 35)", ("Table 35",), "off"),
    ("long-context", "Long context (Table 36)", ("Table 36",), "off"),
]


def part_of(b: Benchmark, mode: str) -> str | None:
    """The part of the report a benchmark's ``mode`` result belongs to."""
    for key, _, prefixes, part_mode in PARTS:
        if part_mode == mode and b.listed.startswith(prefixes):
            return key
    return None


@dataclass
class Line:
    """One row of a written table: a benchmark row in one mode, our number and the report's."""

    benchmark: Benchmark
    label: str
    mode: str
    task: str | None
    metric: str | None
    ours: float | None  # in percent (the catalogue's scale applied), None when there is none
    status: str  # "ok", "failed: ...", "skipped: ...", "absent: ...", "missing metric"
    reference: Any  # catalogue Reference or None

    @property
    def delta(self) -> float | None:
        if self.ours is None or self.reference is None:
            return None
        return self.ours - self.reference.value


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.1f}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def markdown(lines: Sequence[Line], header: dict[str, Any]) -> str:
    """The report as Markdown: a header (model, server, suite, limit, harness versions), then one
    table per part of the report."""
    out = ["# Apertus 1.5 evaluation: our numbers beside the report's", ""]
    for key, value in header.items():
        out.append(f"- {key}: {value}")
    out.append("")
    out.append("Ours: this run, in percent (WER and BLEU as the harness reports them). Report: the technical "
               "report's number for the released Apertus 1.5 8B, cited by table, row and column. "
               "Δ = ours - report. A run with --limit scores a few items: its numbers are a check of the "
               "wiring, not of the model.")
    for key, title, _, _ in PARTS:
        rows = [line for line in lines if part_of(line.benchmark, line.mode) == key]
        if not rows:
            continue
        out += ["", f"## {title}", "",
                "| Benchmark | Ours | Report | Δ | Apertus task | Metric | Report's number | Status |",
                "| --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
        for line in rows:
            lower = " (lower is better)" if not line.benchmark.higher_is_better else ""
            cite = line.reference.cite() if line.reference is not None else "-"
            task = f"`{line.task}`" if line.task else "-"
            metric = f"`{line.metric}`{lower}" if line.metric else "-"
            out.append(f"| {line.label} | {_fmt(line.ours)} | {_fmt(line.reference.value if line.reference else None)} "
                       f"| {_signed(line.delta)} | {task} | {metric} | {cite} | {line.status} |")
    return "\n".join(out) + "\n"


def svg(lines: Sequence[Line], title: str) -> str:
    """Bars per benchmark row, ours beside the report's (only rows with at least one number)."""
    rows = [line for line in lines if line.ours is not None or line.reference is not None]
    label_w, bar_w, row_h, top, pad = 300, 520, 34, 64, 12
    width = label_w + bar_w + 120
    height = top + row_h * max(1, len(rows)) + 40
    top_value = max([100.0] + [v for line in rows for v in (line.ours, line.reference.value if line.reference else None)
                               if v is not None and math.isfinite(v)])
    colors = {"ours": "#d62728", "report": "#7f7f7f"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{pad}" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
             f'<rect x="{label_w}" y="32" width="12" height="12" fill="{colors["ours"]}"/>',
             f'<text x="{label_w + 16}" y="42">ours</text>',
             f'<rect x="{label_w + 70}" y="32" width="12" height="12" fill="{colors["report"]}"/>',
             f'<text x="{label_w + 86}" y="42">report (Apertus 1.5 8B)</text>']
    for k, line in enumerate(rows):
        y = top + k * row_h
        name = line.label + (" (think)" if line.mode == "think" else "") + \
            (" ↓" if not line.benchmark.higher_is_better else "")
        parts.append(f'<text x="{label_w - 8}" y="{y + 17}" text-anchor="end">{escape(name)}</text>')
        for j, (kind, value) in enumerate((("ours", line.ours),
                                            ("report", line.reference.value if line.reference else None))):
            by = y + 3 + j * 13
            if value is None or not math.isfinite(value):
                parts.append(f'<text x="{label_w + 4}" y="{by + 10}" fill="#999999">{kind}: none</text>')
                continue
            w = max(0.0, min(1.0, value / top_value)) * bar_w
            parts.append(f'<rect class="{kind}" x="{label_w}" y="{by}" width="{w:.1f}" height="11" '
                         f'fill="{colors[kind]}"><title>{escape(kind)}: {value:.1f}</title></rect>')
            parts.append(f'<text x="{label_w + w + 4:.1f}" y="{by + 10}">{value:.1f}</text>')
    parts.append(f'<text x="{pad}" y="{height - 14}" fill="#555555">bars scaled to {top_value:g}; ↓ lower is '
                 'better</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------- the catalogue

def counts(benchmarks: Iterable[Benchmark] | None = None) -> dict[str, int]:
    """How many of the report's benchmarks there are, how many have an Apertus task, how many not."""
    items = [b for b in (load() if benchmarks is None else benchmarks) if b.subtask_of is None]
    return {"report benchmarks": len(items), "with an Apertus task": sum(b.runnable for b in items),
            "absent": sum(not b.runnable for b in items)}


_SECTIONS = [("Text: Tables L.1 and L.2", ("L.1", "L.2", "Tables 23")), ("Images: Table 34 (section 5.5)", ("Table 34",)),
             ("Audio: Table 35 (section 5.6)", ("Table 35",)), ("Long context: Table 36 (section 5.7)", ("Table 36",))]


def _upstream(b: Benchmark) -> str:
    if b.kind == "handwritten":
        return "- (this package's task)"
    names = b.upstream if isinstance(b.upstream, tuple) else (b.upstream,)
    harness = "lm-eval" if b.harness == "lm_eval" else "lmms-eval"
    shown = ", ".join(f"`{n}`" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{harness} {shown}"


def _settings(b: Benchmark) -> str:
    parts = [b.setting]
    if b.kind == "chat":
        parts.append("thinking off: greedy, 16,384 tokens")
    if b.think:
        k = b.repeats
        parts.append("`_think`: 0.6 / 0.95, 32,768 tokens" + (f", mean@{k}" if k > 1 else ""))
    if b.kind == "completions":
        parts.append("log-likelihood through the completions API" + (", chat template" if b.chat else ""))
    if b.kind == "base":
        parts.append("upstream's prompt and decoding, no chat template")
    if b.needs:
        parts.append("needs " + ", ".join(b.needs))
    if b.note:
        parts.append(b.note)
    return "; ".join(parts)


def benchmark_table() -> str:
    """The documentation's table of every benchmark of the report (Markdown), counts first."""
    items = load()
    c = counts(items)
    out = [f"Report benchmarks: **{c['report benchmarks']}**; with an Apertus task: **{c['with an Apertus task']}**; "
           f"absent: **{c['absent']}** (the reason in each row)."]
    for title, prefixes in _SECTIONS:
        rows = [b for b in items if b.listed.startswith(prefixes)]
        sc = counts(rows)
        out += ["", f"### {title}", "",
                f"{sc['report benchmarks']} benchmarks, {sc['with an Apertus task']} with an Apertus task, "
                f"{sc['absent']} absent.", "",
                "| Benchmark | Listed | Upstream task | Apertus task | Settings, or why absent | Suites |",
                "| --- | --- | --- | --- | --- | --- |"]
        for b in rows:
            name = f"{b.name} (a part of {b.subtask_of}, not counted)" if b.subtask_of else b.name
            if b.runnable:
                tasks = ", ".join(f"`{t}`" for t in b.tasks.values())
                out.append(f"| {name} | {b.listed} | {_upstream(b)} | {tasks} | {_settings(b)} | {', '.join(b.suites)} |")
            else:
                out.append(f"| {name} | {b.listed} | - | - | absent: {b.absent} ({b.setting}) | - |")
    return "\n".join(out) + "\n"
