"""The table of the report's settings (``report_settings/*.yaml``) against the code, and its generated docs page.

Every row whose locator the core environment can read is checked here (the Megatron recipes' rows in
``tests/megatron/test_report_settings_megatron.py``): the locator resolves, gives the row's code value,
and the status agrees with the report's value. The report's text is not needed: the quotes are checked
by ``tools/check_report_settings.py``, as ``tools/check_report_numbers.py`` checks the evaluation's numbers.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from apertus_plugins.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


TOOL = load_script(ROOT / "tools" / "report_settings.py", "apertus_report_settings_tool")
ROWS = TOOL.load()
CORE_ROWS = [r for r in ROWS if r.suite == "core"]


def test_the_table_covers_every_area_and_each_row_has_a_suite() -> None:
    assert {r.area for r in ROWS} >= {"targets", "goldfish", "packing", "pretraining", "long_context", "sft", "dpo",
                                      "sdpo", "rlvr", "evaluation", "tokenization"}
    assert {r.suite for r in ROWS} == {"core", "megatron"}
    assert len(ROWS) >= 100


@pytest.mark.parametrize("row", CORE_ROWS, ids=[r.id for r in CORE_ROWS])
def test_row_agrees_with_the_code(row) -> None:  # noqa: ANN001 - a table row
    assert TOOL.check_row(row) == []


def test_a_changed_value_or_a_lost_locator_fails() -> None:
    row = next(r for r in CORE_ROWS if r.id == "targets.text_only.omni_weight")
    assert TOOL.check_row(row) == []
    wrong = replace(row, code={**row.code, "value": 1.0})
    assert any("gives 0.0" in p for p in TOOL.check_row(wrong))
    gone = replace(row, code={**row.code, "locator": "py:apertus_plugins.core.targets:NO_SUCH_NAME"})
    assert any("does not resolve" in p for p in TOOL.check_row(gone))
    assert any("does not resolve" in p for p in TOOL.check_row(replace(row, code={
        **row.code, "locator": "yaml:verl_ext/config/no_such.yaml#a.b"})))
    lying = replace(row, status="differs", reason="x")
    assert any("agree" in p for p in TOOL.check_row(lying))
    unset = next(r for r in CORE_ROWS if r.id == "rlvr.optimizer")
    assert unset.status == "differs" and TOOL.check_row(unset) == []


def test_malformed_rows_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "- {id: x, setting: s, report: {value: 1, where: w, quote: q}, code: {value: 2, locator: 'py::1'}, "
        "status: differs}\n", encoding="utf-8")
    with pytest.raises(TOOL.TableError, match="needs a reason"):
        TOOL.load(tmp_path)
    (tmp_path / "a.yaml").write_text(
        "- {id: x, setting: s, report: {value: 1, where: w, quote: q}, code: {value: 1, locator: 'py::1'}, "
        "status: equal}\n- {id: x, setting: s, report: {value: 1, where: w, quote: q}, code: {value: 1, "
        "locator: 'py::1'}, status: equal}\n", encoding="utf-8")
    with pytest.raises(TOOL.TableError, match="also in"):
        TOOL.load(tmp_path)


def test_the_docs_page_is_the_generated_one() -> None:
    """docs/report-conformance.md is what ``tools/report_settings.py --write`` writes from the table."""
    assert TOOL.DOCS_PAGE.read_text(encoding="utf-8") == TOOL.render(ROWS), (
        "docs/report-conformance.md is stale: run python3 tools/dev.py run core python tools/report_settings.py --write")


def test_the_checker_reads_the_reports_spellings_of_numbers() -> None:
    """``tools/check_report_settings.py`` (run by hand against the report) finds values as the report writes them."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        spec = importlib.util.spec_from_file_location("apertus_check_report_settings", ROOT / "tools" /
                                                      "check_report_settings.py")
        checker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(checker)
    finally:
        sys.path.remove(str(ROOT / "tools"))
    for text, value in (("Peak learning rate 1.1\\times 10^{-4}", 1.1e-4), ("Sequence length 8,192", 8192),
                        ("62.9B, 58.7B", 62.9e9), ("grows to 2M", 2e6), ("decays to 10% of", 0.1),
                        ("at 24 kHz", 24000), ("\\epsilon=10^{-8}", 1e-8), ("clipped at a ratio of two", 2),
                        ("a peak of -3 dBFS", -3), ("roughly one million trajectories", 1e6)):
        assert any(abs(n - value) <= 1e-9 * abs(value) for n in checker.numbers(text)), (text, value)
    assert -64 not in checker.numbers("the top-64 tokens")
    assert checker.normalize("see [Table 2](https://x/y#T2 \"Table 2 (a)\") and\n more") == "see Table 2 and more"
