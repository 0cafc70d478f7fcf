"""The table of the technical report's settings (``report_settings/*.yaml``): load, resolve, render.

    python3 tools/dev.py run core python tools/report_settings.py --write   # docs/report-conformance.md
    python3 tools/dev.py run core python tools/report_settings.py --list    # rows, status, code value

Each YAML file of ``report_settings/`` is one area (a list of rows). A row::

    - id: cpt.8b.peak_lr                    # unique over the table
      setting: peak learning rate, 8B continued pretraining
      report:
        value: 1.1e-4                        # the report's value (a number, a string, a bool, a list)
        where: Table G.1                     # section, table or appendix
        quote: "Peak learning rate 1.1\\times 10^{-4}"   # verbatim (whitespace aside) from the report
        literal: "..."                       # optional: the words of the quote that state the value
        stated: false                        # optional: the value is not written in the quote (e.g. "unchanged")
      code:
        locator: "recipe:cpt-8b:--lr"        # where the code's value is read (below); none: nothing in the code
        value: 1.1e-4                        # what the locator gives today (null without a locator)
      status: equal                          # equal | differs | not-applicable
      reason: "..."                          # required for differs and not-applicable
      reading: "..."                         # where the report is silent or ambiguous: the reading chosen

Locators (the code's value is read, never restated):

* ``py:MODULE:EXPR``: ``EXPR`` evaluated in ``MODULE``'s namespace (an attribute path, a call, a subscript;
  Python's builtins); ``cfg('PATH#KEY')`` reads a YAML locator inside it; ``py::EXPR`` has no module;
* ``default:MODULE:FUNC(PARAM)``: the default of parameter ``PARAM`` of ``FUNC`` (a dotted path in ``MODULE``);
* ``recipe:NAME:--FLAG``: the value of ``--FLAG`` in the shipped Megatron recipe ``NAME`` (True for a switch);
* ``yaml:PATH#KEY.KEY``: a key path into a YAML file of the repository; a key the file does not set reads
  as ``None`` (the framework's default applies), a missing file fails; ``#K.K,K.K`` gives a list.

A row's suite is where its locator can be read: ``recipe:`` and ``megatron_patches`` rows in the megatron
suite (torch), every other row in the core suite; the tests of both suites call :func:`check_row`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TABLE_DIR = ROOT / "report_settings"
DOCS_PAGE = ROOT / "docs" / "report-conformance.md"
STATUSES = ("equal", "differs", "not-applicable")
#: Area files in the order the page lists them (a file not named here comes after, by name).
AREAS = ("data", "tokenization", "targets", "packing", "goldfish", "pretraining", "long_context", "sft",
         "dpo", "sdpo", "rlvr", "evaluation")
_MISSING = object()


class TableError(ValueError):
    """A row of the table is malformed, or its locator does not resolve."""


@dataclass(frozen=True)
class Row:
    area: str
    id: str
    setting: str
    report: dict[str, Any]
    code: dict[str, Any]
    status: str
    reason: str | None
    reading: str | None

    @property
    def locator(self) -> str | None:
        return self.code.get("locator")

    @property
    def suite(self) -> str:
        """The test suite whose environment can read this row's locator."""
        scheme, _, rest = (self.locator or "").partition(":")
        if scheme == "recipe" or (scheme in ("py", "default") and rest.startswith("megatron_patches")):
            return "megatron"
        return "core"


def _yaml() -> Any:
    import yaml

    return yaml


def load(directory: Path = TABLE_DIR) -> list[Row]:
    """Every row of every area file, checked for shape (ids unique, status known, reasons where needed)."""
    rows: list[Row] = []
    seen: dict[str, str] = {}
    files = sorted(directory.glob("*.yaml"), key=lambda p: (AREAS.index(p.stem) if p.stem in AREAS else len(AREAS),
                                                              p.stem))
    if not files:
        raise TableError(f"{directory}: no area files (*.yaml)")
    for path in files:
        data = _yaml().safe_load(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise TableError(f"{path.name}: an area file is a list of rows, got {type(data).__name__}")
        for k, item in enumerate(data):
            where = f"{path.name} row {k + 1}"
            if not isinstance(item, dict):
                raise TableError(f"{where}: a row is a mapping")
            unknown = set(item) - {"id", "setting", "report", "code", "status", "reason", "reading"}
            if unknown:
                raise TableError(f"{where}: unknown keys {sorted(unknown)}")
            for key in ("id", "setting", "report", "code", "status"):
                if key not in item:
                    raise TableError(f"{where}: no {key!r}")
            rid = str(item["id"])
            if rid in seen:
                raise TableError(f"{where}: id {rid!r} is also in {seen[rid]}")
            seen[rid] = path.name
            report, code = item["report"], item["code"]
            if not isinstance(report, dict) or not {"value", "where", "quote"} <= set(report):
                raise TableError(f"{where} ({rid}): report needs value, where and quote")
            if not isinstance(code, dict) or "value" not in code:
                raise TableError(f"{where} ({rid}): code needs a value (and a locator)")
            status = item["status"]
            if status not in STATUSES:
                raise TableError(f"{where} ({rid}): status {status!r}; choose {', '.join(STATUSES)}")
            if status != "equal" and not item.get("reason"):
                raise TableError(f"{where} ({rid}): a {status} row needs a reason")
            if status == "equal" and not code.get("locator"):
                raise TableError(f"{where} ({rid}): an equal row needs a code locator")
            if not code.get("locator") and code["value"] is not None:
                raise TableError(f"{where} ({rid}): a code value without a locator (null: nothing in the code)")
            rows.append(Row(path.stem, rid, str(item["setting"]), report, code, status, item.get("reason"),
                            item.get("reading")))
    return rows


# ------------------------------------------------------------------------------------------------ locators
def _import(name: str) -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(name)


def _recipe_value(name: str, flag: str) -> Any:
    from megatron_patches.recipes import recipe_flags, split_flags

    groups = [g for g in split_flags(recipe_flags(name)) if g[0] == flag]
    if not groups:
        raise TableError(f"recipe {name} has no flag {flag}")
    values = groups[-1][1:]
    if not values:
        return True
    return values[0] if len(values) == 1 else values


def _key_path(node: Any, keys: str) -> Any:
    for key in keys.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def resolve(locator: str) -> Any:
    """The code's value at ``locator`` (see the module docstring); :class:`TableError` when it does not resolve."""
    scheme, _, rest = locator.partition(":")
    try:
        if scheme == "py":
            module, _, expr = rest.partition(":")
            namespace = dict(vars(_import(module))) if module else {}
            namespace["cfg"] = lambda key: resolve(f"yaml:{key}")
            return eval(expr, namespace)  # noqa: S307 - the table's own expressions, reviewed like code
        if scheme == "default":
            module, _, call = rest.partition(":")
            func_path, _, param = call.partition("(")
            obj = _import(module)
            for part in func_path.split("."):
                obj = getattr(obj, part)
            default = inspect.signature(obj).parameters[param.rstrip(")")].default
            if default is inspect.Parameter.empty:
                raise TableError(f"{locator}: the parameter has no default")
            return default
        if scheme == "recipe":
            name, _, flag = rest.partition(":")
            return _recipe_value(name, flag)
        if scheme == "yaml":
            path, _, keys = rest.partition("#")
            data: Any = _yaml().safe_load((ROOT / path).read_text(encoding="utf-8"))
            values = [_key_path(data, k) for k in keys.split(",")]
            return values[0] if len(values) == 1 else values
    except TableError:
        raise
    except Exception as exc:  # an import, attribute, key or file that is gone
        raise TableError(f"{locator}: does not resolve ({type(exc).__name__}: {exc})") from exc
    raise TableError(f"{locator}: unknown scheme {scheme!r} (py, default, recipe, yaml)")


def _number(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return None
    return None


def same(a: Any, b: Any) -> bool:
    """Whether two values of the table agree: numbers (a number-like string included) to 1e-9 relative,
    sequences element by element, mappings key by key, anything else by equality."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        return math.isclose(na, nb, rel_tol=1e-9, abs_tol=0.0) or na == nb
    return a == b


def check_row(row: Row) -> list[str]:
    """What is wrong with ``row`` against the code: [] when the locator gives the row's code value and the
    status agrees with the two values (equal: they agree; differs: they do not)."""
    problems: list[str] = []
    if row.locator:
        try:
            got = resolve(row.locator)
        except TableError as exc:
            return [f"{row.id}: {exc}"]
        if not same(_plain(got), row.code["value"]):
            problems.append(f"{row.id}: {row.locator} gives {_plain(got)!r}, the table says {row.code['value']!r}")
    agree = same(row.report["value"], row.code["value"])
    if row.status == "equal" and not agree:
        problems.append(f"{row.id}: status equal, but the report says {row.report['value']!r} and the code "
                        f"{row.code['value']!r}")
    if row.status == "differs" and agree:
        problems.append(f"{row.id}: status differs, but the report and the code agree ({row.code['value']!r})")
    return problems


def _plain(x: Any) -> Any:
    """Tuples as lists, mappings with plain values: the shapes YAML can hold."""
    if isinstance(x, tuple | list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


# ------------------------------------------------------------------------------------------------ the page
def _fmt(x: Any) -> str:
    if x is None:
        return "unset (the framework's default)"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:g}"
    if isinstance(x, list):
        return ", ".join(_fmt(v) for v in x)
    if isinstance(x, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in x.items())
    return str(x)


def _code(row: Row) -> str:
    return _fmt(row.code["value"]) if row.locator else "not in the code"


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render(rows: list[Row]) -> str:
    """The docs page: what the project knowingly does otherwise than the report, the readings of silent or
    ambiguous passages, and the whole table, area by area."""
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    out = [
        "# Conformance with the technical report",
        "",
        "<!-- generated by tools/report_settings.py --write from report_settings/*.yaml; do not edit -->",
        "",
        "Every setting the Apertus 1.5 technical report states for data processing, tokenization, loss targets,",
        "packing, Goldfish, the optimizer and schedule of each stage, long context, SFT, DPO, SDPO, RLVR and the",
        "evaluation protocol that this project implements (or should), one row each in `report_settings/*.yaml`:",
        "the report's value and where it says so, and the code's value read from the code itself. The core and",
        "megatron test suites fail when the code and the table disagree; `tools/check_report_settings.py REPORT`",
        "confirms each quote and value against the report's text.",
        "",
        f"{len(rows)} settings: {counts['equal']} equal, {counts['differs']} differ, "
        f"{counts['not-applicable']} not applicable.",
        "",
        "## Where the project differs from the report",
        "",
        "| setting | the report | the code | why |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.status == "differs":
            out.append(f"| {_cell(r.setting)} (`{r.id}`) | {_cell(_fmt(r.report['value']))} ({_cell(r.report['where'])})"
                       f" | {_cell(_code(r))} | {_cell(r.reason)} |")
    out += ["", "## Readings of silent or ambiguous passages", "", "| setting | reading chosen |", "| --- | --- |"]
    for r in rows:
        if r.reading:
            out.append(f"| {_cell(r.setting)} (`{r.id}`) | {_cell(r.reading)} |")
    out += ["", "## Not applicable", "", "| setting | the report | why |", "| --- | --- | --- |"]
    for r in rows:
        if r.status == "not-applicable":
            out.append(f"| {_cell(r.setting)} (`{r.id}`) | {_cell(_fmt(r.report['value']))} | {_cell(r.reason)} |")
    out += ["", "## The whole table"]
    area = None
    for r in rows:
        if r.area != area:
            area = r.area
            out += ["", f"### {area.replace('_', ' ')}", "", "| setting | the report | where | the code | read at | status |",
                    "| --- | --- | --- | --- | --- | --- |"]
        out.append(f"| {_cell(r.setting)} | {_cell(_fmt(r.report['value']))} | {_cell(r.report['where'])}: "
                   f"\"{_cell(r.report['quote'])}\" | {_cell(_code(r))} | "
                   f"`{_cell(r.locator or '-')}` | {r.status} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOCS_PAGE.relative_to(ROOT)}")
    parser.add_argument("--list", action="store_true", help="print each row, its status and its code value")
    args = parser.parse_args(argv)
    rows = load()
    if args.write:
        DOCS_PAGE.write_text(render(rows), encoding="utf-8")
        print(f"wrote {DOCS_PAGE.relative_to(ROOT)} ({len(rows)} rows)")
    if args.list or not args.write:
        for r in rows:
            print(f"{r.status:15} {r.suite:9} {r.id}: report {_fmt(r.report['value'])}; code {_code(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
