"""Check every row of the report-settings table (``report_settings/*.yaml``) against the text of the technical report.

    python3 tools/dev.py run core python tools/check_report_settings.py [path/to/report.txt]

Without a path it reads ``shared/seed/000_8f0a8fb36c050ffe.txt`` in the nearest folder above the checkout
that has it (``../shared`` beside a clone). For each row it
finds the quote in the report (markdown links reduced to their text, white space collapsed), then the
value in the quote: the row's ``literal`` when it has one (those words must be in the quote, and a number
among them must be the value), else the value itself (a number written in any of the report's spellings:
``8,192``, ``1.1\\times 10^{-4}``, ``62.9B``, ``2M``, ``10%``; a word or name, case aside; a list, each
element). A row marked ``stated: false`` (a value the report gives by reference, e.g. "unchanged") has its
quote checked only. It prints one line per row and the counts, and exits 1 when a quote or a value is not
found. The report is not part of the repository; the check is run by whoever edits the table.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_settings import ROOT, load  # noqa: E402

#: The report beside the checkout: ``shared/seed/...`` in the nearest folder above it that has one.
REPORT_NAME = Path("shared") / "seed" / "000_8f0a8fb36c050ffe.txt"


def default_report() -> Path:
    for parent in ROOT.parents:
        if (parent / REPORT_NAME).is_file():
            return parent / REPORT_NAME
    return ROOT.parent / REPORT_NAME
_LINK = re.compile(r"\[([^\]]*)\]\((?:[^()]|\([^()]*\))*\)")
_SCALE = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
_NUM = re.compile(r"((?:(?<![A-Za-z0-9])-)?\d[\d,]*(?:\.\d+)?)(?:\\times\s*10\^\{(-?\d+)\}|\s*([KMBT])\b|(%)|\s*(kHz))?")
_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
          "ten": 10, "zero": 0, "no": 0}
_WORD_SCALES = {"thousand": 1e3, "million": 1e6, "billion": 1e9}


def normalize(text: str) -> str:
    """Markdown links to their text, white space collapsed."""
    return " ".join(_LINK.sub(r"\1", text).split())


def numbers(text: str) -> list[float]:
    """Every number ``text`` writes, in every reading: ``4.2B`` is 4.2 and 4.2e9, ``10%`` 10 and 0.1."""
    out: list[float] = []
    for m in _NUM.finditer(text):
        base = float(m.group(1).replace(",", ""))
        out.append(base)
        if m.group(2) is not None:
            out.append(base * 10 ** int(m.group(2)))
        if m.group(3):
            out.append(base * _SCALE[m.group(3)])
        if m.group(4):
            out.append(base / 100)
        if m.group(5):
            out.append(base * 1000)
    for m in re.finditer(r"(?<![\d.])10\^\{(-?\d+)\}", text):
        out.append(10.0 ** int(m.group(1)))
    for word, value in _WORDS.items():
        for m in re.finditer(rf"\b{word}\b(?:\s+(thousand|million|billion))?", text, re.IGNORECASE):
            out.append(float(value))
            if m.group(1):  # "one million" is 1e6
                out.append(float(value) * _WORD_SCALES[m.group(1).lower()])
    return out


def _value_in(value: Any, text: str) -> bool:
    if isinstance(value, list):
        return all(_value_in(v, text) for v in value)
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, (int, float)):
        return any(abs(n - value) <= 1e-9 * max(1.0, abs(value)) for n in numbers(text))
    return str(value).lower() in text.lower()


def check(row: Any, report: str) -> tuple[str, str]:
    """(verdict, detail) of one row: ``ok``, ``quoted`` (the value is given by reference), ``QUOTE`` (not found)
    or ``VALUE`` (the quote does not state the value)."""
    quote = normalize(str(row.report["quote"]))
    if quote not in report:
        return "QUOTE", f"quote not in the report: {quote[:90]!r}"
    if row.report.get("stated") is False:
        return "quoted", "quote found; the value is given by reference"
    literal = row.report.get("literal")
    value = row.report["value"]
    if literal is not None:
        literal = normalize(str(literal))
        if literal not in quote:
            return "VALUE", f"literal {literal!r} not in the quote"
        if isinstance(value, (int, float, list)) and not isinstance(value, bool) and numbers(literal):
            if not _value_in(value, literal):
                return "VALUE", f"{literal!r} does not state {value!r}"
        return "ok", f"{literal!r}"
    if not _value_in(value, quote):
        return "VALUE", f"{value!r} not in the quote"
    return "ok", "value in the quote"


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] in ("-h", "--help")):
        print(__doc__)
        return 2
    path = Path(argv[0]) if argv else default_report()
    if not path.is_file():
        print(f"no report at {path}: pass its path")
        return 2
    report = normalize(path.read_text(encoding="utf-8"))
    counts: dict[str, int] = {}
    for row in load():
        verdict, detail = check(row, report)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"{verdict:7} {row.id} ({row.report['where']}): {detail}")
    bad = counts.get("QUOTE", 0) + counts.get("VALUE", 0)
    print(f"{sum(counts.values())} rows: {counts.get('ok', 0)} ok, {counts.get('quoted', 0)} quoted only "
          f"(value by reference), {counts.get('QUOTE', 0)} quote not found, {counts.get('VALUE', 0)} value not "
          f"in the quote")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
