"""The written report: Markdown tables with our numbers beside the report's, and a picture.

- :func:`markdown`: one table per part of the report (text with thinking off and on, the base
  model, images, audio, long context): the benchmark, our number, the report's number for the
  released 8B and the difference, the Apertus task and the metric read, and where the report's
  number stands (table, row, column); a benchmark without an Apertus task is listed with why.
- :func:`svg`: bars per benchmark, ours beside the report's, written as SVG text directly (no
  plotting library: the picture is a few rectangles and labels, deterministic byte for byte).
- :func:`terminal`: a per-suite summary to read at a glance in a terminal: ours, the report's,
  the difference as a signed bar coloured by sign and size (ANSI colours, none with ``NO_COLOR``).
- :func:`html`: the same as a self-contained page (no script, no network): the difference cell
  coloured by sign and size, the protocol of each row in a column and the report's on hover.
- :func:`benchmark_table`: the catalogue as the documentation's table (every benchmark of the
  report, the upstream task, the Apertus task and settings, or why it is absent), with counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from eval_tasks.catalogue import Benchmark, cited_protocol, load

__all__ = ["Line", "PARTS", "benchmark_table", "counts", "html", "markdown", "part_of", "svg", "terminal"]

#: The parts of the report's tables, in order: (key, title, the catalogue's ``listed`` prefixes, mode).
PARTS: list[tuple[str, str, tuple[str, ...], str]] = [
    ("text", "Text, thinking off (Tables L.1-L.3, 23, 27, 29, 31, 37)", ("L.1", "L.2", "Tables 23", "Tables 31"), "off"),
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
        """Ours - the report's; None without both, or where the report's number is for another protocol."""
        if self.ours is None or self.reference is None or self.reference.unlike:
            return None
        return self.ours - self.reference.value

    @property
    def protocol(self) -> str:
        """What this row runs: metric, shots, category set, thinking mode."""
        return self.benchmark.protocol(self.mode).describe()

    @property
    def cited(self) -> str:
        """What the report ran for its number, and where the number stands; the reason where it is unlike."""
        if self.reference is None:
            return "the report gives no number for this row"
        text = f"{self.reference.cite()}: {cited_protocol(self.benchmark, self.reference).describe()}"
        return text + (f"; not compared: {self.reference.unlike}" if self.reference.unlike else "")

    @property
    def better(self) -> float | None:
        """The difference in the benchmark's direction (positive: ours is better)."""
        d = self.delta
        return None if d is None else d if self.benchmark.higher_is_better else -d


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
            if line.reference is not None and line.reference.unlike:
                cite += f" (not compared: {line.reference.unlike})"
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


#: The difference's colour classes by size, in points (|Δ| below each bound): close, apart, far.
_BANDS = (2.0, 5.0)


def _band(better: float | None) -> str:
    """``none``, ``close`` or ``better-N``/``worse-N`` (N = 1 or 2 by size) for a difference."""
    if better is None:
        return "none"
    size = abs(better)
    if size < _BANDS[0]:
        return "close"
    return f"{'better' if better > 0 else 'worse'}-{1 if size < _BANDS[1] else 2}"


_ANSI = {"close": "2", "better-1": "32", "better-2": "1;32", "worse-1": "33", "worse-2": "1;31", "none": "2"}


def _parts(lines: Sequence[Line]) -> list[tuple[str, list[Line]]]:
    out = []
    for key, title, _, _ in PARTS:
        rows = [line for line in lines if part_of(line.benchmark, line.mode) == key]
        if rows:
            out.append((title, rows))
    return out


def terminal(lines: Sequence[Line], color: bool = True, width: int = 12) -> str:
    """A summary per part of the report, one line per row: ours, the report's, the difference as a
    bar of up to ``width`` cells (one per point, ``<`` worse, ``>`` better in the benchmark's
    direction), coloured by sign and size; rows without a comparison say why."""
    out = []
    for title, rows in _parts(lines):
        compared = [r for r in rows if r.better is not None]
        close = sum(abs(r.better) < _BANDS[0] for r in compared)  # type: ignore[arg-type]
        out += ["", f"{title}: {len(compared)} compared, {close} within {_BANDS[0]:g} points"]
        name_w = max(len(r.label) + (2 if not r.benchmark.higher_is_better else 0) for r in rows)
        for r in rows:
            name = r.label + (" ↓" if not r.benchmark.higher_is_better else "")
            head = f"  {name:<{name_w}}  {_fmt(r.ours):>6}  {_fmt(r.reference.value if r.reference else None):>6}"
            if r.better is None:
                why = (f"not compared: {r.reference.unlike}" if r.reference is not None and r.reference.unlike
                       else r.status if r.status != "ok" else "no number in the report")
                out.append(f"{head}  {'':>{width * 2 + 9}}  {why}")
                continue
            cells = min(width, int(round(abs(r.better))))
            bar = (" " * (width - cells) + "<" * cells + "|" + " " * width) if r.better < 0 else \
                (" " * width + "|" + ">" * cells + " " * (width - cells))
            delta = f"{_signed(r.delta):>7}"
            if color:
                code = _ANSI[_band(r.better)]
                bar, delta = f"\x1b[{code}m{bar}\x1b[0m", f"\x1b[{code}m{delta}\x1b[0m"
            out.append(f"{head}  {delta} {bar}  {r.protocol}")
    legend = (f"ours, the report's, Δ = ours - report; the bar: one cell a point, > better, < worse in the "
              f"benchmark's direction (↓ lower is better); |Δ| < {_BANDS[0]:g} close, < {_BANDS[1]:g} apart, else far")
    return "\n".join([legend, *out]) + "\n"


_CSS = """body{font-family:sans-serif;margin:16px;color:#222}table{border-collapse:collapse;margin-bottom:24px}
th,td{border:1px solid #ccc;padding:3px 8px;font-size:13px}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.delta{text-align:right;font-weight:bold}.none{color:#888}.close{background:#eeeeee}
.better-1{background:#c7e9c0}.better-2{background:#41ab5d;color:white}.worse-1{background:#fdd0a2}
.worse-2{background:#d94801;color:white}td.why{color:#666;font-size:12px}caption{text-align:left;font-weight:bold;
padding:6px 0}.legend span{display:inline-block;padding:2px 8px;margin-right:6px;border:1px solid #ccc}"""


def html(lines: Sequence[Line], title: str, header: dict[str, Any] | None = None) -> str:
    """The comparison as one static HTML page: a table per part of the report; the difference cell
    coloured by sign and size (its class: ``better-1``...), our protocol in a column and the report's
    (with its table, row and column) on hover over the report's number and in the last column."""
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{escape(title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{escape(title)}</h1>"]
    if header:
        out.append("<ul>" + "".join(f"<li>{escape(str(k))}: {escape(str(v))}</li>" for k, v in header.items()) + "</ul>")
    out.append('<p class="legend">Δ = ours - report, coloured in the benchmark\'s direction: '
               '<span class="better-2">far better</span><span class="better-1">better</span>'
               f'<span class="close">within {_BANDS[0]:g}</span><span class="worse-1">worse</span>'
               f'<span class="worse-2">far worse (≥ {_BANDS[1]:g})</span><span class="none">not compared</span></p>')
    for part, rows in _parts(lines):
        out += [f'<table data-part="{escape(part)}"><caption>{escape(part)}</caption>',
                "<tr><th>Benchmark</th><th>Ours</th><th>Report</th><th>Δ</th><th>Our protocol</th>"
                "<th>The report's number</th><th>Status</th></tr>"]
        for r in rows:
            name = r.label + (" ↓" if not r.benchmark.higher_is_better else "")
            ref = r.reference.value if r.reference else None
            band = _band(r.better)
            out.append(f'<tr data-benchmark="{escape(r.benchmark.id)}" data-mode="{r.mode}"><td>{escape(name)}</td>'
                       f'<td class="num">{_fmt(r.ours)}</td>'
                       f'<td class="num" title="{escape(r.cited)}">{_fmt(ref)}</td>'
                       f'<td class="delta {band}">{_signed(r.delta)}</td><td>{escape(r.protocol)}</td>'
                       f'<td class="why">{escape(r.cited)}</td><td class="why">{escape(r.status)}</td></tr>')
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- the catalogue

def counts(benchmarks: Iterable[Benchmark] | None = None) -> dict[str, int]:
    """How many of the report's benchmarks there are, how many have an Apertus task, how many not."""
    items = [b for b in (load() if benchmarks is None else benchmarks) if b.subtask_of is None]
    return {"report benchmarks": len(items), "with an Apertus task": sum(b.runnable for b in items),
            "absent": sum(not b.runnable for b in items)}


_SECTIONS = [("Text: Tables L.1 and L.2, machine translation (Tables 31 and 32)", ("L.1", "L.2", "Tables 23", "Tables 31")), ("Images: Table 34 (section 5.5)", ("Table 34",)),
             ("Audio: Table 35 (section 5.6)", ("Table 35",)), ("Long context: Table 36 (section 5.7)", ("Table 36",))]


def _upstream(b: Benchmark) -> str:
    if b.template:
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
    if b.base_run:
        parts.append(f"base model: `{b.tasks['base']}`, without the chat template")
    if b.categories != "all":
        parts.append(f"categories: {b.categories}")
    if b.needs:
        parts.append("needs " + ", ".join(b.needs))
    if b.report_judge:
        parts.append(f"the report's judge: {b.report_judge}")
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
