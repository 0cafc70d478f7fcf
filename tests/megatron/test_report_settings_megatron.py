"""The rows of the report-settings table (``report_settings/*.yaml``) that the Megatron adapter holds.

The recipes import torch (AdEMAMix), so their rows are checked here; every other row is checked in the
core suite (``tests/core/test_report_settings.py``). Each locator must resolve and give the row's code
value, and the status must agree with the report's value. Also here: a stage and a target preset that
contradict each other run as asked and log the divergence once.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from apertus_plugins.testing.scripts import load_script
from megatron_patches.arguments import add_apertus_args, options_from_args

ROOT = Path(__file__).resolve().parents[2]


TOOL = load_script(ROOT / "tools" / "report_settings.py", "apertus_report_settings_tool")
ROWS = [r for r in TOOL.load() if r.suite == "megatron"]


def test_the_megatron_rows_are_there() -> None:
    assert len(ROWS) >= 40 and {r.area for r in ROWS} >= {"pretraining", "long_context", "sft", "goldfish"}


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_row_agrees_with_the_recipes(row) -> None:  # noqa: ANN001 - a table row
    assert TOOL.check_row(row) == []


def _options(tokenizer_dir: Path, *argv: str):  # noqa: ANN202 - ApertusOptions
    parser = argparse.ArgumentParser()
    add_apertus_args(parser)
    return options_from_args(parser.parse_args([*argv, "--apertus-tokenizer", str(tokenizer_dir)]))


def test_a_stage_sets_the_reports_targets_and_a_contradiction_is_logged_once(
        tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="apertus_plugins.report"):
        stage2 = _options(tokenizer_dir, "--apertus-stage", "2", "--apertus-goldfish-k", "50")
        assert stage2.targets.modality_weights["omni"] == 0.0 and stage2.targets.modality_weights["image"] == 0.0
        assert _options(tokenizer_dir, "--apertus-stage", "1", "--apertus-goldfish-k", "50").targets.modality_weights == {}
        assert caplog.records == []
        for _ in range(2):  # the user's choice runs; the divergence is logged once
            opts = _options(tokenizer_dir, "--apertus-stage", "long-context", "--apertus-targets", "all",
                            "--apertus-goldfish-k", "50")
            assert opts.targets.modality_weights == {}
            _options(tokenizer_dir, "--apertus-stage", "3", "--apertus-goldfish-k", "50",
                     "--apertus-modality-weight", "image=0.5")
            _options(tokenizer_dir, "--apertus-stage", "1")  # Goldfish off
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert "'text-only' targets" in messages[0] and "Table 2" in messages[0]
    assert "--apertus-modality-weight image=0.5" in messages[1] and "text only" in messages[1]
    assert "k = 50, h = 50" in messages[2]


def test_all_modality_targets_on_a_long_context_recipe_run_and_are_logged(
        tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A stage-2+ recipe with --apertus-targets all: the user's flag wins over the recipe's, the recipe's stage
    stays, and the divergence names the report's value."""
    from apertus_plugins.core import divergence
    from megatron_patches.recipes import expand_recipes

    argv, _report = expand_recipes(["--apertus-recipe", "long-context-8b-64k", "--apertus-targets", "all"])
    assert argv[argv.index("--apertus-stage") + 1] == "long-context"
    assert argv[argv.index("--apertus-targets") + 1] == "all" and argv.count("--apertus-targets") == 1
    parser = argparse.ArgumentParser()
    add_apertus_args(parser)
    known, _ = parser.parse_known_args([*argv, "--apertus-tokenizer", str(tokenizer_dir)])
    with caplog.at_level(logging.WARNING, logger="apertus_plugins.report"):
        opts = options_from_args(known)
    assert opts.targets.modality_weights == {}  # every modality trained, as asked
    # logged once per process: here, or by an earlier test of this module with the same stage and preset
    assert "targets:long-context:all" in divergence.seen()
