"""The ``apertus`` pytest plugin: a package outside this repository gets the fixtures through the entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from apertus_plugins.testing import pytest_plugin


def test_the_plugin_is_registered_under_pytest11() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert found.get("apertus") == "apertus_plugins.testing.pytest_plugin"


def test_a_third_party_test_file_gets_the_fixtures_without_a_conftest(tmp_path: Path) -> None:
    """A bare test file in a fresh folder (no conftest, no ``pytest_plugins`` line) uses the fixtures."""
    (tmp_path / "test_third_party.py").write_text(
        "import socket\n"
        "def test_fixtures(apertus_small_spec, apertus_tokenizer_dir, apertus_free_port, apertus_image_part):\n"
        "    assert apertus_small_spec.text_size < 131072\n"
        "    assert (apertus_tokenizer_dir / 'tokenizer.json').is_file()\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', apertus_free_port))\n"
        "    assert apertus_image_part['image_url']['url'].startswith('data:image/png;base64,')\n"
        "def test_the_plugin_can_be_turned_off():\n"
        "    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout
    off = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:apertus",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert off.returncode == 1 and "fixture 'apertus_small_spec' not found" in off.stdout, off.stdout[-2000:]


def test_every_fixture_is_documented_on_the_plugins_page() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    names = [n for n in dir(pytest_plugin) if n.startswith("apertus_") and callable(getattr(pytest_plugin, n))]
    assert len(names) >= 10
    assert [n for n in names if f"`{n}`" not in page] == []
