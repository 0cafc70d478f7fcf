"""``tools/dev.py``: the Debian packages a suite lists in ``tests/<suite>/debian.txt``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dev(tests: Path):  # noqa: ANN202 - the module
    spec = importlib.util.spec_from_file_location("apertus_dev_tool", ROOT / "tools" / "dev.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    dev.TESTS = tests
    return dev


def test_the_core_suite_lists_chromium_and_it_is_installed() -> None:
    dev = _dev(ROOT / "tests")
    assert dev.debian_packages("core") == ["chromium", "fonts-dejavu-core"]
    dev.ensure_debian_packages("core")  # installed by the command that runs this suite: nothing to do
    assert all(dev._installed(p) for p in dev.debian_packages("core"))
    assert dev.debian_packages("megatron") == []


def test_a_package_that_cannot_be_installed_stops_with_the_suite_and_the_package(tmp_path: Path) -> None:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "debian.txt").write_text("# a comment\ndpkg  # present everywhere\n"
                                                  "apertus-no-such-package-x\n")
    dev = _dev(tmp_path)
    assert dev.debian_packages("demo") == ["dpkg", "apertus-no-such-package-x"]
    with pytest.raises(SystemExit, match=r"suite demo needs the Debian packages apertus-no-such-package-x "
                                         r"\(tests/demo/debian.txt\), and `apt-get install -y -q "
                                         r"apertus-no-such-package-x` failed \(exit 100\)"):
        dev.ensure_debian_packages("demo")
