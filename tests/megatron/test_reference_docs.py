"""The docs' reference pages generated from the code are the pages the code writes today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_generated_reference_pages_are_current() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_reference_docs.py"), "--check"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_apertus_flag_has_a_row() -> None:
    import argparse

    from megatron_patches.arguments import add_apertus_args

    parser = add_apertus_args(argparse.ArgumentParser(add_help=False))
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--apertus-")}
    page = (ROOT / "docs" / "megatron-flags.md").read_text()
    assert len(flags) > 20 and [f for f in sorted(flags) if f"| `{f}` |" not in page] == []
