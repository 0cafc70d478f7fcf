"""What ``apertus inspect`` shows of one document: tokens by role and training state, media spans whole.

:func:`document_view` cuts a document into pieces: single tokens (with their role and whether
their label is trained, untrained or dropped by Goldfish) and media spans (an image from
``<|img_start|>`` to ``<|img_end|>`` with its grid and layout, a clip from ``<|audio_start|>`` to
``<|audio_end|>``), and counts tokens and labels per role. :func:`render_text` prints it for a
terminal (a media span on one line, ANSI colours unless ``NO_COLOR`` is set or the output is not a
terminal); :func:`render_html` writes one self-contained HTML page (inline CSS, no script, no
external resource): the tokens coloured by role and marked by training state, each image as its
code grid, each clip as a strip of codes, a legend and the per-role counts.

Label ``j`` is ``ids[j+1]`` (as in ``--json``): a token's training state is the state of the
label that predicts it; the first token has none.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from apertus_plugins.core.chat.tokenize import ROLES
from apertus_plugins.core.media.image import ImageLayoutError, image_layouts_in
from apertus_plugins.core.vocab import VocabSpec

__all__ = ["VIEW_ROLES", "DocumentView", "MediaSpan", "Token", "document_view", "render_html", "render_text"]

#: Roles of the view: the chat roles of the core's encoder, and ``text`` for tokens outside every
#: turn (a pretraining document).
VIEW_ROLES: tuple[str, ...] = (*ROLES, "text")
#: The block a structure token opens (its own role is ``structure``); closers return to ``text``.
_OPENS = {"system_start": "system", "developer_start": "developer", "user_start": "user",
          "assistant_start": "assistant", "tool_output_start": "tool", "tool_output_end": "assistant"}
_CLOSES = ("system_end", "developer_end", "user_end", "assistant_end", "bos", "eos")
_SPANS = {"image": ("img_start", "img_end"), "audio": ("audio_start", "audio_end")}

#: Colours of the roles (background) and the training states (HTML and legend).
ROLE_COLOURS = {"structure": "#9aa5b1", "system": "#f6c177", "developer": "#e9a6f5", "user": "#8ec5ff",
                "assistant": "#9be39b", "tool": "#ffd166", "image": "#f28e8e", "audio": "#7fd8d2", "text": "#d9d9d9"}
STATE_COLOURS = {"trained": "#1a7f37", "untrained": "#ffffff", "dropped": "#cf222e"}
_ANSI_ROLE = {"structure": "1;36", "system": "33", "developer": "35", "user": "34", "assistant": "32", "tool": "33",
              "image": "35", "audio": "36", "text": "0"}


@dataclass
class Token:
    position: int
    id: int
    text: str
    role: str
    state: str  # "trained", "untrained", "dropped" (the label predicting this token), "none" for position 0


@dataclass
class MediaSpan:
    modality: str
    start: int
    stop: int  # exclusive
    codes: np.ndarray  # codebook indices in order (row-major for an image)
    grid: tuple[int, int] | None = None
    layout: str | None = None
    problem: str | None = None
    trained: int = 0
    dropped: int = 0

    def summary(self) -> str:
        n = f"{self.codes.size:,} codes"
        if self.modality == "image":
            if self.problem:
                return f"[image · {self.stop - self.start:,} ids · {self.problem}]"
            rows, cols = self.grid or (0, 0)
            text = f"[image {rows}x{cols} · {n} · {self.layout} layout"
        else:
            text = f"[audio · {n} · {self.codes.size / 40:.2f} s"
        if self.trained:
            text += f" · {self.trained:,} trained" + (f", {self.dropped:,} dropped" if self.dropped else "")
        return text + "]"


@dataclass
class DocumentView:
    title: str
    pieces: list[Token | MediaSpan]
    tokens: Counter = field(default_factory=Counter)  # role -> tokens
    trained: Counter = field(default_factory=Counter)  # role -> trained labels
    dropped: Counter = field(default_factory=Counter)  # role -> dropped labels
    labels: int = 0
    goldfish: str = ""

    def counts(self) -> list[tuple[str, int, int, int]]:
        """``(role, tokens, trained, dropped)`` for each role present, in :data:`VIEW_ROLES` order."""
        return [(r, self.tokens[r], self.trained[r], self.dropped[r]) for r in VIEW_ROLES if self.tokens[r]]


def _image_span(ids: np.ndarray, spec: VocabSpec) -> tuple[np.ndarray, tuple[int, int] | None, str | None, str | None]:
    try:
        (layout,) = image_layouts_in(ids, spec)
    except (ImageLayoutError, ValueError) as exc:
        return np.zeros(0, dtype=np.int64), None, None, f"malformed: {exc}"
    body = ids[int(np.flatnonzero(ids == spec.id("img_token_start"))[0]) + 1: -1]
    eol, eof = spec.id("img_end_of_row"), spec.id("img_end_of_frame")
    rows = int(np.count_nonzero(body == eol)) + (0 if layout == "training" else 1)
    lo, size = spec.modality("image").offset, spec.modality("image").size
    cells = body[(body != eol) & (body != eof)]
    codes = np.where((cells >= lo) & (cells < lo + size), cells - lo, -1)  # -1: a placeholder, not a code
    cols = codes.size // max(rows, 1)
    return codes, (rows, cols), layout, None


def document_view(ids: Sequence[int], sft_mask: Sequence[bool], goldfish_drop: Sequence[bool], spec: VocabSpec,
                  decode: Callable[[int], str] | None = None, title: str = "", goldfish: str = "") -> DocumentView:
    """The pieces and counts of one document (``sft_mask``/``goldfish_drop`` indexed by label position)."""
    arr = np.asarray(ids, dtype=np.int64)
    mask = np.asarray(sft_mask, dtype=bool)
    drop = np.asarray(goldfish_drop, dtype=bool)
    names = spec.id_to_name
    starts = {spec.id(a): (m, spec.id(b)) for m, (a, b) in _SPANS.items()}
    code_lo = min((m.offset for m in spec.modalities), default=spec.size)
    view = DocumentView(title, [], labels=len(mask), goldfish=goldfish)
    block = "text"

    def state(p: int) -> str:
        if p == 0 or p - 1 >= len(mask):
            return "none"
        if not mask[p - 1]:
            return "untrained"
        return "dropped" if p - 1 < len(drop) and drop[p - 1] else "trained"

    def count(role: str, p: int) -> str:
        s = state(p)
        view.tokens[role] += 1
        if s in ("trained", "dropped"):
            view.trained[role] += 1
        if s == "dropped":
            view.dropped[role] += 1
        return s

    p = 0
    while p < arr.size:
        tid = int(arr[p])
        if tid in starts:
            modality, end_id = starts[tid]
            ends = np.flatnonzero(arr[p + 1:] == end_id)
            if ends.size:
                stop = p + 2 + int(ends[0])
                span_ids = arr[p:stop]
                if modality == "image":
                    codes, grid, layout, problem = _image_span(span_ids, spec)
                else:
                    lo, size = spec.modality("audio").offset, spec.modality("audio").size
                    inner = span_ids[1:-1]
                    codes, grid, layout, problem = inner[(inner >= lo) & (inner < lo + size)] - lo, None, None, None
                span = MediaSpan(modality, p, stop, codes, grid, layout, problem)
                for q in range(p, stop):
                    s = count(modality, q)
                    span.trained += s in ("trained", "dropped")
                    span.dropped += s == "dropped"
                view.pieces.append(span)
                p = stop
                continue
        name = names.get(tid)
        if name is not None and tid in spec.special_ids:
            role = "structure"
        elif tid >= code_lo:
            role = spec.modality_names[int(spec.modality_of(tid))]
        else:
            role = block
        if name is not None and decode is None:
            text = f"<|{name}|>"
        elif decode is not None:
            text = decode(tid)
        elif tid >= code_lo:
            text = f"[{role} {tid}]"
        else:
            text = f"{tid} "
        view.pieces.append(Token(p, tid, text, role, count(role, p)))
        if name in _OPENS:
            block = _OPENS[name]
        elif name in _CLOSES:
            block = "text"
        p += 1
    return view


# ---------------------------------------------------------------------- terminal
_RESET = "\033[0m"


def _ansi(token: Token) -> str:
    if token.state == "trained":
        return "\033[1;32m"  # bold green: a trained label
    if token.state == "dropped":
        return "\033[9;31m"  # struck red: trained but dropped by Goldfish
    return f"\033[{_ANSI_ROLE.get(token.role, '0')}m" if token.role == "structure" else "\033[2m"


def render_text(view: DocumentView, color: bool) -> str:
    """The document for a terminal: tokens inline, each media span on a line of its own, then the counts."""
    out: list[str] = []
    for piece in view.pieces:
        if isinstance(piece, MediaSpan):
            line = piece.summary()
            out.append("\n" + (f"\033[{_ANSI_ROLE[piece.modality]}m{line}{_RESET}" if color else line) + "\n")
        elif color:
            out.append(f"{_ansi(piece)}{piece.text}{_RESET}")
        else:
            t = piece.text
            out.append(f"[+{t}]" if piece.state == "trained" else f"[-{t}]" if piece.state == "dropped" else t)
    total = sum(view.tokens.values())
    lines = ["".join(out), "",
             f"{total} tokens, {view.labels} labels: {sum(view.trained.values())} trained (SFT mask), "
             f"{sum(view.dropped.values())} dropped by Goldfish ({view.goldfish})"]
    lines.append("by role: " + ", ".join(f"{r} {n:,} ({t:,} trained)" for r, n, t, _d in view.counts()))
    if color:
        lines.append(f"legend: \033[1;32mtrained{_RESET} \033[9;31mdropped{_RESET} "
                     f"\033[1;36mstructure{_RESET} \033[2muntrained{_RESET}; media spans on lines of their own")
    else:
        lines.append("legend: [+...] trained label, [-...] dropped by Goldfish; media spans on lines of their own")
    return "\n".join(lines)


# ---------------------------------------------------------------------- HTML
def _code_colour(code: int, modality: str) -> str:
    if code < 0:
        return "#8c959f"
    hue = (code * 137.508) % 360  # golden-angle spread: neighbouring codes differ visibly
    light = 45 + (code % 3) * 10
    return f"hsl({hue:.0f},{'70%' if modality == 'image' else '55%'},{light}%)"


def _css() -> str:
    roles = "\n".join(f".r-{r} {{ background: {c}; }}" for r, c in ROLE_COLOURS.items())
    return f"""
body {{ font: 14px/1.5 system-ui, sans-serif; margin: 16px; color: #1f2328; background: #ffffff; }}
h1 {{ font-size: 18px; margin: 0 0 8px; }}
#legend, #counts {{ margin: 8px 0 12px; }}
#legend .item {{ display: inline-flex; align-items: center; margin: 0 14px 6px 0; }}
.swatch {{ display: inline-block; width: 28px; height: 16px; margin-right: 6px; border: 1px solid #57606a; }}
table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #d0d7de; padding: 2px 10px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
#tokens {{ font: 13px/1.9 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }}
.t {{ border-bottom: 3px solid transparent; padding: 0 1px; }}
.s-trained {{ border-bottom-color: {STATE_COLOURS['trained']}; }}
.s-dropped {{ border-bottom-color: {STATE_COLOURS['dropped']}; text-decoration: line-through; }}
.s-untrained, .s-none {{ opacity: 0.75; }}
figure {{ margin: 6px 0; padding: 6px; border: 1px solid #d0d7de; display: table; white-space: normal; }}
figcaption {{ font: 12px system-ui, sans-serif; margin-bottom: 4px; }}
.grid {{ display: inline-grid; gap: 0; }}
.grid i, .strip i {{ display: block; width: 6px; height: 6px; }}
.strip {{ display: flex; flex-wrap: wrap; max-width: 960px; }}
{roles}
"""


def render_html(view: DocumentView) -> str:
    """One self-contained HTML page of the document (see the module docstring)."""
    esc = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{esc(view.title)}</title><style>{_css()}</style></head><body>",
             f"<h1>{esc(view.title)}</h1>", '<div id="legend">']
    for r in VIEW_ROLES:
        parts.append(f'<span class="item"><span class="swatch r-{r}"></span>{esc(r)}</span>')
    for s, c in STATE_COLOURS.items():
        parts.append(f'<span class="item"><span class="swatch" style="background:{c}"></span>{esc(s)} label</span>')
    parts.append("</div>")
    total = sum(view.tokens.values())
    parts.append(f'<p id="summary">{total:,} tokens, {view.labels:,} labels: {sum(view.trained.values()):,} trained '
                 f"(SFT mask), {sum(view.dropped.values()):,} dropped by Goldfish ({esc(view.goldfish)})</p>")
    parts.append('<table id="counts"><tr><th>role</th><th>tokens</th><th>trained</th><th>dropped</th></tr>')
    for r, n, t, d in view.counts():
        parts.append(f'<tr class="role-{r}"><td><span class="swatch r-{r}"></span>{esc(r)}</td><td>{n:,}</td>'
                     f"<td>{t:,}</td><td>{d:,}</td></tr>")
    parts.append("</table>")
    body_parts: list[str] = []
    for piece in view.pieces:
        if isinstance(piece, MediaSpan):
            caption = esc(piece.summary()[1:-1])
            cells = "".join(f'<i style="background:{_code_colour(int(c), piece.modality)}" title="{int(c)}"></i>'
                            for c in piece.codes)
            if piece.modality == "image" and piece.grid:
                body = (f'<div class="grid" style="grid-template-columns: repeat({piece.grid[1]}, 6px)">'
                        f"{cells}</div>")
            else:
                body = f'<div class="strip">{cells}</div>'
            body_parts.append(f'<figure class="media r-{piece.modality}" data-start="{piece.start}">'
                              f"<figcaption>{caption}</figcaption>{body}</figure>")
        else:
            label = "no label" if piece.state == "none" else f"label {piece.position - 1}: {piece.state}"
            body_parts.append(f'<span class="t r-{piece.role} s-{piece.state}" title="id {piece.id} · {piece.role} · '
                              f'{label}">{esc(piece.text)}</span>')
    # tokens side by side: no whitespace between them (the tokens' own text keeps its spaces and newlines)
    parts.append('<div id="tokens">' + "".join(body_parts) + "</div></body></html>")
    return "\n".join(parts) + "\n"


def view_json(view: DocumentView) -> dict[str, Any]:
    """The counts of a view as JSON-ready data (used by tests and scripts)."""
    return {"counts": {r: {"tokens": n, "trained": t, "dropped": d} for r, n, t, d in view.counts()},
            "media": [{"modality": m.modality, "start": m.start, "codes": int(m.codes.size), "grid": m.grid,
                       "layout": m.layout} for m in view.pieces if isinstance(m, MediaSpan)]}
