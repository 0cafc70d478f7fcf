"""Check every reference number of the evaluation catalogue against the text of the technical report.

    python3 tools/dev.py run eval python tools/check_report_numbers.py path/to/report.txt

For each number of ``eval_tasks/catalogue.yaml`` (``[value, table, row, column]``, the 8B's and the
70B's) it finds the table in the report's text (its caption ``Table N:``, or the appendix's
``Table L.3:``), the row (the line that starts with the row's name followed by numbers) and the
column's position, and compares; for each cited table's setting (the catalogue's ``tables``) it
finds the quoted words in that table's caption. It prints one line per number and per table, the
counts last, and exits 1 when one differs or cannot be found. The report is not part of the
repository; the check is run by whoever edits the catalogue.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval_tasks.catalogue import load, tables  # noqa: E402

#: The position of each cited column among a row's numbers, by table.
COLUMNS = {
    ("L.3", "8B +SDPO"): 3, ("27", "8B +SDPO"): 3, ("28", "8B +SDPO"): 3, ("25", "8B On"): 1,
    ("34", "8B"): 0, ("34", "8Bth"): 1, ("35", "Apertus 1.5 8B"): 0, ("39", "Apertus 1.5 8B"): 1,
    **{(t, "Apertus 1.5 8B"): 1 for t in ("13", "15", "17", "19", "21", "23", "29")},
    **{(t, "Apertus 1.5 70B"): 1 for t in ("14", "16", "18", "20", "22", "24", "30", "35")},
    ("L.3", "70B +DPO"): 6, ("27", "70B +DPO"): 6, ("28", "70B +DPO"): 6, ("25", "8B Off"): 0, ("25", "70B Off"): 2,
    ("25", "70B On"): 3, ("34", "70B"): 2, ("37", "Apertus 1.5 8B"): 2, ("37", "Apertus 1.5 70B"): 3,
    ("39", "Apertus 1.5 70B"): 3,
    **{("36", f"{n}k"): k for k, n in enumerate((8, 16, 32, 64, 128, 256))},
    **{("36", f"HELMET {n}k"): 6 + k for k, n in enumerate((8, 16, 32, 64, 128))},
}
_NUMBER = r"(?:\d+(?:\.\d+)?†?|–)"


def table_block(text: str, table: str) -> str:
    start = text.find(f"Table {table}:")
    if start < 0:
        raise LookupError(f"no caption 'Table {table}:'")
    end = len(text)
    for marker in ("\nTable ", "\n### ", "\n## ", "\n#### "):
        found = text.find(marker, start + 10)
        if 0 <= found < end:
            end = found
    return text[start:end]


def row_numbers(block: str, row: str) -> list[str]:
    """The numbers of the line that starts with ``row`` (a parenthesis after the name is the cite's
    context, not part of the row's text); a mark (†, *) or an arrow may follow the name."""
    names = ["after SDPO"] if row == "Apertus 1.5 8B after SDPO" else [row, re.sub(r"\s*\(.*\)$", "", row)]
    mark = r"(?:[†*]|\s*\\(?:up|down)arrow)?"
    for name in names:
        pattern = re.compile(rf"^{re.escape(name)}{mark}((?:\s*{_NUMBER})+)\s*$", re.MULTILINE)
        found = pattern.findall(block)
        if len(found) == 1:
            return [n.rstrip("†") for n in re.findall(_NUMBER, found[0])]
    raise LookupError(f"row {row!r}: no single matching line")


def caption(text: str, table: str) -> str:
    """The caption of ``table``: its line, from ``Table N:`` on."""
    start = text.find(f"Table {table}:")
    if start < 0:
        raise LookupError(f"no caption 'Table {table}:'")
    end = text.find("\n", start)
    return text[start:end if end >= 0 else len(text)]


def report_value(text: str, table: str, row: str, column: str) -> str:
    """The report's cell (as printed) of ``row`` and ``column`` in ``table``."""
    return row_numbers(table_block(text, table), row)[COLUMNS[(table, column)]]


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 1:
        print(__doc__)
        return 2
    if not Path(argv[0]).is_file():
        print(f"check_report_numbers: {argv[0]}: no such file (give the report's text)", file=sys.stderr)
        return 2
    text = Path(argv[0]).read_text(encoding="utf-8")
    bad = numbers = 0
    for b in load():
        cited = [(f"{mode}", ref) for row in b.rows for mode, ref in row.reference.items()]
        cited += [(f"{mode} 70B", ref) for mode, ref in b.reference_70b.items()]
        for mode, ref in cited:
            numbers += 1
            where = f"{b.id} {mode}: {ref.cite()} = {ref.value:g}"
            try:
                got = report_value(text, ref.table, ref.row, ref.column)
            except (LookupError, KeyError, IndexError) as exc:
                print(f"MISSING  {where}: {exc!r}")
                bad += 1
                continue
            ok = got not in ("–", "-") and abs(float(got) - ref.value) < 1e-9
            bad += not ok
            print(f"{'ok      ' if ok else 'DIFFERS '}{where}" + ("" if ok else f" (the report: {got})"))
    for key, table in tables().items():
        try:
            ok = " ".join(table.quote.split()) in " ".join(caption(text, key).split())
        except LookupError as exc:
            ok, table = False, table
            print(f"MISSING  Table {key}: {exc!r}")
        else:
            print(f"{'ok      ' if ok else 'DIFFERS '}Table {key} caption: {table.quote!r}")
        bad += not ok
    print(f"{numbers} numbers and {len(tables())} table settings checked; {bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
