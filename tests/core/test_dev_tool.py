"""``tools/dev.py`` and ``tools/envs.py``: suites' Debian packages, the nox sessions, pytest arguments, the summary."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str, tests: Path | None = None):  # noqa: ANN202 - the module
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        spec = importlib.util.spec_from_file_location(f"apertus_{name}_tool", ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "tools"))
    if tests is not None:
        module.TESTS = tests
    return module


def test_the_core_suite_lists_chromium_and_it_is_installed() -> None:
    envs = _module("envs", ROOT / "tests")
    assert envs.debian_packages("core") == ["chromium", "fonts-dejavu-core"]
    envs.ensure_debian_packages("core")  # installed by the command that runs this suite: nothing to do
    assert all(envs._installed(p) for p in envs.debian_packages("core"))
    assert envs.debian_packages("megatron") == []


def test_a_package_that_cannot_be_installed_stops_with_the_suite_and_the_package(tmp_path: Path) -> None:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "debian.txt").write_text("# a comment\ndpkg  # present everywhere\n"
                                                  "apertus-no-such-package-x\n")
    envs = _module("envs", tmp_path)
    assert envs.debian_packages("demo") == ["dpkg", "apertus-no-such-package-x"]
    with pytest.raises(SystemExit, match=r"suite demo needs the Debian packages apertus-no-such-package-x "
                                         r"\(tests/demo/debian.txt\), and `apt-get -o DPkg::Lock::Timeout=900 install -y -q "
                                         r"apertus-no-such-package-x` failed \(exit 100\)"):
        envs.ensure_debian_packages("demo")


def test_every_suite_folder_is_a_nox_session_and_the_reverse() -> None:
    envs = _module("envs")
    folders = sorted(p.parent.name for p in (ROOT / "tests").glob("*/requirements.txt"))
    assert sorted(envs.SUITES) == folders
    noxfile = (ROOT / "noxfile.py").read_text()
    assert "envs.SUITES" in noxfile and "session.posargs" in noxfile and "--junitxml" in noxfile


def test_the_summary_is_read_from_junit_reports(tmp_path: Path) -> None:
    dev = _module("dev")
    report = tmp_path / "s.xml"
    report.write_text('<?xml version="1.0"?><testsuites><testsuite name="s" tests="7" failures="2" errors="1" '
                      'skipped="1" time="90.5"></testsuite></testsuites>')
    assert dev.junit_counts(report) == (3, 2, 1, 1, 90.5)
    assert dev.junit_counts(tmp_path / "missing.xml") is None
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite")
    assert dev.junit_counts(tmp_path / "cut.xml") is None


def test_pytest_arguments_after_the_separator_select_one_test(tmp_path: Path) -> None:
    """``python3 tools/dev.py test SUITE -- -k NAME`` runs that test alone, and its report says so."""
    env = dict(os.environ, APERTUS_TEST_REPORTS=str(tmp_path))
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "APERTUS_SUITE"):
        env.pop(key, None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if "venvs" not in p)
    done = subprocess.run(["python3", str(ROOT / "tools" / "dev.py"), "test", "docs", "--", "-k",
                           "every_page_of_docs_is_in_the_navigation"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout
    assert _module("dev").junit_counts(tmp_path / "docs.xml")[:4] == (1, 0, 0, 0)
    assert " min" in done.stdout.split("==== suites")[-1]  # each suite's time is in the summary


def test_the_background_build_takes_each_environment_once_in_the_order_the_sessions_need_them(tmp_path: Path) -> None:
    for suite, needs in (("a", ""), ("b", "c  # the other one\n"), ("c", ""), ("d", "a\nc\n")):
        (tmp_path / suite).mkdir()
        if needs:
            (tmp_path / suite / "needs.txt").write_text(needs)
    envs = _module("envs", tmp_path)
    assert envs.build_order(["a", "b", "c", "d"]) == ["a", "b", "c", "d"]
    assert envs.build_order(["d", "b"]) == ["d", "a", "c", "b"]
    assert envs.build_order(["b"]) == ["b", "c"]


def test_a_background_build_that_fails_names_the_environment_and_goes_on(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broken").mkdir()  # no requirements.txt: build_env stops naming it
    envs = _module("envs", tmp_path)
    assert envs.prebuild(["broken"]) == 1
    assert "prebuild: broken failed" in capsys.readouterr().out


def test_no_background_build_when_turned_off_or_with_nothing_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _module("dev")
    monkeypatch.setenv("APERTUS_PREBUILD", "0")
    assert dev.start_prebuild(["docs", "core"], dict(os.environ)) is None
    monkeypatch.delenv("APERTUS_PREBUILD")
    assert dev.start_prebuild(["docs"], dict(os.environ)) is None  # one suite that needs no other: nothing ahead


def test_an_environment_another_process_is_building_is_waited_for_and_said_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import fcntl
    import threading
    import time

    envs = _module("envs")
    lock = tmp_path / ".vllm-0123.lock"
    got = threading.Event()
    with open(lock, "a+") as held:  # the other builder (a second open file: flock excludes it in this process too)
        fcntl.flock(held, fcntl.LOCK_EX)

        def waiter() -> None:
            with envs._locked(lock):
                got.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        deadline = time.monotonic() + 30
        out = ""
        while "waiting for vllm-0123" not in out and time.monotonic() < deadline:
            time.sleep(0.05)
            out += capsys.readouterr().out
        assert "waiting for vllm-0123: another process is building it" in out
        assert not got.is_set()
        fcntl.flock(held, fcntl.LOCK_UN)
    thread.join(30)
    assert got.is_set()
