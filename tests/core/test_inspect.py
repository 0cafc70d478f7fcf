"""``apertus inspect``: media spans on one line each, NO_COLOR, and the HTML page in a real headless Chromium.

The document is a conversation with an 87x87 image in the training layout (7,569 codes) and a
clip, as ``apertus tokenize`` writes it. The terminal view runs under a real pseudo-terminal.
The HTML page is loaded by Debian's ``chromium`` (installed by ``tools/dev.py`` from
``tests/core/debian.txt``): a screenshot must show every legend colour inside the legend's box,
and the laid-out page must show the per-role counts inside the window.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from apertus_plugins.cli import main
from apertus_plugins.cli._view import ROLE_COLOURS, STATE_COLOURS, VIEW_ROLES, document_view, view_json
from apertus_plugins.core.goldfish import goldfish_drop
from apertus_plugins.core.media.audio import audio_sequence
from apertus_plugins.core.media.image import byte_text_ids, image_sequence
from apertus_plugins.core.targets import sft_mask
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.data.indexed import write_indexed_dataset

ROOT = Path(__file__).resolve().parents[2]
SPEC = VocabSpec()


def conversation() -> list[int]:
    I = SPEC.id  # noqa: E741
    rng = np.random.default_rng(3)
    image = image_sequence(rng.integers(0, 131072, (87, 87)), SPEC, "training", byte_text_ids()).tolist()
    clip = audio_sequence(rng.integers(0, 4096, 50), SPEC).tolist()
    return [I("bos"), I("system_start"), 300, 301, I("system_end"), I("developer_start"), 302, I("developer_end"),
            I("user_start"), *image, 400, *clip, 401, 402, I("user_end"), I("assistant_start"),
            *rng.integers(75, 1000, 160).tolist(), I("tools_prefix"), 500, I("tools_suffix"), I("tool_output_start"),
            600, 601, I("tool_output_end"), 700, I("assistant_end"), I("eos")]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    prefix = tmp_path_factory.mktemp("inspect") / "sft"
    write_indexed_dataset(prefix, [[5, 6, 7], conversation()])
    return str(prefix)


GOLDFISH = ["--goldfish-k", "3", "--goldfish-h", "2"]


def test_media_spans_are_one_line_each_and_the_counts_are_per_role(dataset: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", dataset, "--index", "1", *GOLDFISH]) == 0
    text = capsys.readouterr().out
    assert "\033[" not in text  # not a terminal: no colours
    lines = text.splitlines()
    assert "[image 87x87 · 7,569 codes · training layout]" in lines
    assert "[audio · 50 codes · 1.25 s]" in lines
    assert len(lines) < 15 and len(text) < 6000  # not 7,569 codes' worth
    assert "[+" in text and "[-" in text and "<|assistant_start|>" in text
    ids = np.array(conversation())
    mask, drop = sft_mask(ids, SPEC), goldfish_drop(ids[1:], k=3, h=2, spec=SPEC)
    counts = view_json(document_view(ids, mask, drop, SPEC))["counts"]
    assert counts["image"]["tokens"] == 1 + len("87*87") + 1 + 87 * 88 + 2  # start, header, token start, rows, tail
    assert counts["audio"] == {"tokens": 52, "trained": 0, "dropped": 0}
    assert counts["tool"]["trained"] == 0 and sum(c["trained"] for c in counts.values()) == int(mask.sum())
    assert counts["structure"]["trained"] == 3  # <|tools_prefix|>, <|tools_suffix|>, <|assistant_end|>
    assert sum(c["dropped"] for c in counts.values()) == int((mask & drop).sum()) > 0
    assert sum(c["tokens"] for c in counts.values()) == ids.size
    by_role = next(line for line in lines if line.startswith("by role: "))
    assert "assistant 162 (162 trained)" in by_role and "image 7,665 (0 trained)" in by_role


def _run_on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """``apertus ARGS`` with its stdout on a real pseudo-terminal; returns what it wrote."""
    leader, follower = pty.openpty()
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    proc = subprocess.Popen([sys.executable, "-m", "apertus_plugins.cli", *args], stdout=follower,
                            stderr=subprocess.PIPE, env=full)
    os.close(follower)
    out = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    return out.decode("utf-8", errors="replace")


def test_colours_on_a_terminal_unless_no_color(dataset: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    coloured = _run_on_a_terminal(["inspect", dataset, "--index", "1", *GOLDFISH], {**env, "NO_COLOR": ""})
    assert "\033[1;32m" in coloured and "\033[35m[image 87x87 · 7,569 codes · training layout]" in coloured
    plain = _run_on_a_terminal(["inspect", dataset, "--index", "1", *GOLDFISH], {"NO_COLOR": "1"})
    assert "\033[" not in plain and "[image 87x87 · 7,569 codes · training layout]" in plain


# ---------------------------------------------------------------------------------------------- the HTML page
_PROBE = """<script>
window.addEventListener("load", () => {
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };
  const rows = [...document.querySelectorAll("#counts tr")].map((tr) => ({
    text: tr.innerText.replace(/\\s+/g, " ").trim(), box: box(tr),
    shown: getComputedStyle(tr).visibility === "visible" && tr.getClientRects().length > 0}));
  const grid = document.querySelector("figure.r-image .grid");
  document.body.setAttribute("data-layout", JSON.stringify({
    legend: box(document.getElementById("legend")), counts: box(document.getElementById("counts")), rows,
    viewport: [innerWidth, innerHeight], dpr: devicePixelRatio, grid: grid ? box(grid) : null,
    cells: grid ? grid.children.length : 0}));
});
</script>"""


def _chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    assert exe, "Debian's chromium is needed (tests/core/debian.txt; python3 tools/dev.py test core installs it)"
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    profile.mkdir()
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--hide-scrollbars", "--force-device-scale-factor=1", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def test_the_html_page_in_headless_chromium(dataset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    page = tmp_path / "doc.html"
    assert main(["inspect", dataset, "--index", "1", *GOLDFISH, "--html", str(page)]) == 0
    capsys.readouterr()
    source = page.read_text(encoding="utf-8")
    assert "<script" not in source and "http" not in source.split("<body>")[0]  # self-contained, static
    probed = tmp_path / "probed.html"
    probed.write_text(source.replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    size = (1280, 1400)

    dom = _chromium("--dump-dom", "--virtual-time-budget=3000", f"--window-size={size[0]},{size[1]}",
                    probed.as_uri(), tmp=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r'data-layout="([^"]*)"', dom.stdout)
    assert m, dom.stdout[:2000]
    layout = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    vw, vh = layout["viewport"]
    ids = np.array(conversation())
    mask, drop = sft_mask(ids, SPEC), goldfish_drop(ids[1:], k=3, h=2, spec=SPEC)
    counts = view_json(document_view(ids, mask, drop, SPEC))["counts"]
    rows = {r["text"].split(" ")[0]: r for r in layout["rows"]}
    for role, c in counts.items():  # each role's row shows its numbers, laid out inside the window
        row = rows[role]
        assert row["text"] == f"{role} {c['tokens']:,} {c['trained']:,} {c['dropped']:,}", row
        x, y, w, h = row["box"]
        assert row["shown"] and w > 0 and h > 0 and 0 <= x and x + w <= vw and 0 <= y and y + h <= vh, row
    assert layout["cells"] == 87 * 87  # the image as its grid
    gx, gy, gw, gh = layout["grid"]
    assert abs(gw - 87 * 6) < 1 and abs(gh - 87 * 6) < 1

    shot = tmp_path / "doc.png"
    run = _chromium(f"--screenshot={shot}", f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=3000",
                    probed.as_uri(), tmp=tmp_path)
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    img = np.asarray(Image.open(shot).convert("RGB"))
    x, y, w, h = (int(round(v)) for v in layout["legend"])
    assert w > 200 and h > 10 and y + h <= img.shape[0]
    legend = img[y:y + h, x:x + w].reshape(-1, 3)
    for name, colour in [*ROLE_COLOURS.items(), *((f"{s} label", c) for s, c in STATE_COLOURS.items())]:
        hits = int(np.all(legend == np.array(_rgb(colour)), axis=1).sum())
        assert hits >= 200, f"legend colour of {name} ({colour}) is not visible in the screenshot ({hits} pixels)"
    assert set(ROLE_COLOURS) == set(VIEW_ROLES)
    cx, cy, cw, ch = (int(round(v)) for v in layout["counts"])
    table = img[cy:cy + ch, cx:cx + cw].reshape(-1, 3)
    dark = int((table.sum(axis=1) < 200).sum())
    assert dark > 300, "the counts table shows no text in the screenshot"
