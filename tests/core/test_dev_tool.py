"""``tools/dev.py`` and ``tools/envs.py``: suites' Debian packages, the nox sessions, pytest arguments, the summary."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str, tests: Path | None = None):  # noqa: ANN202 - the module
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        spec = importlib.util.spec_from_file_location(f"apertus_{name}_tool", ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
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


def test_the_background_build_follows_the_lanes_and_leaves_the_first_ones_to_their_sessions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _module("dev")
    started: list[list[str]] = []

    class Started:
        def __init__(self, cmd: list[str], **_kw: object) -> None:
            started.append(cmd)
            self.pid = 0

    monkeypatch.setattr(dev.subprocess, "Popen", Started)
    monkeypatch.setattr(dev, "REPORTS", tmp_path)
    order = dev.lanes.start_order(["docs", "core", "verl-train", "megatron-train", "vllm"])
    assert order == ["verl-train", "vllm", "megatron-train", "core", "docs"]
    dev.start_prebuild(order, dict(os.environ), 2)
    (cmd,) = started
    # verl-train's and vllm's sessions start at once and build their own; what vllm needs is built beside them
    assert cmd[cmd.index("prebuild") + 1:] == ["reference", "megatron-train", "core", "docs"]
    dev.start_prebuild(["docs", "core", "vllm"], dict(os.environ))  # one at a time: all but the first one's
    assert started[1][started[1].index("prebuild") + 1:] == ["core", "vllm", "reference"]


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


def _sleeper(marks: Path, seconds: float = 1.0):  # noqa: ANN202 - the command factory
    """A command per suite that writes its start and end times to ``marks/<suite>`` and exits 0 (``bad``: 3)."""
    code = ("import sys, time; from pathlib import Path; p = Path(sys.argv[1]); t0 = time.time(); "
            f"time.sleep({seconds}); p.write_text(f'{{t0}} {{time.time()}}'); sys.exit(3 if p.name == 'bad' else 0)")
    return lambda suite: [sys.executable, "-c", code, str(marks / suite)]


def _spans(marks: Path) -> dict[str, tuple[float, float]]:
    return {p.name: tuple(map(float, p.read_text().split())) for p in marks.iterdir()}


def test_two_suites_run_at_once_and_the_longest_starts_first(tmp_path: Path) -> None:
    lanes = _module("lanes")
    marks = tmp_path / "marks"
    marks.mkdir()
    said: list[str] = []
    done = lanes.run_parallel(["docs", "core", "verl-train"], _sleeper(marks), jobs=2, logs=tmp_path / "logs",
                              env=dict(os.environ), cwd=tmp_path, say=said.append, budget_gib=100, poll=0.1)
    assert {f.suite for f in done} == {"docs", "core", "verl-train"} and all(f.returncode == 0 for f in done)
    spans = _spans(marks)
    # verl-train (the longest) and core start together; docs waits for a free job
    assert said[0].startswith("verl-train: started") and said[1].startswith("core: started beside verl-train")
    assert spans["core"][0] < spans["verl-train"][1] and spans["verl-train"][0] < spans["core"][1]
    assert spans["docs"][0] >= min(spans["core"][1], spans["verl-train"][1]) - 0.05
    assert (tmp_path / "logs" / "docs.log").is_file()


def test_suites_whose_peaks_do_not_fit_together_run_one_after_the_other(tmp_path: Path) -> None:
    lanes = _module("lanes")
    marks = tmp_path / "marks"
    marks.mkdir()
    budget = lanes.PEAK_GIB["verl-train"] + lanes.PEAK_GIB["vllm"] - 1  # the two serving suites do not fit
    done = lanes.run_parallel(["vllm", "verl-train"], _sleeper(marks, 0.5), jobs=2, logs=tmp_path / "logs",
                              env=dict(os.environ), cwd=tmp_path, say=lambda _: None, budget_gib=budget, poll=0.1)
    assert [f.suite for f in done] == ["verl-train", "vllm"]
    spans = _spans(marks)
    assert spans["vllm"][0] >= spans["verl-train"][1] - 0.05


def test_a_failed_suite_is_reported_with_its_exit_and_the_others_still_run(tmp_path: Path) -> None:
    lanes = _module("lanes")
    marks = tmp_path / "marks"
    marks.mkdir()
    said: list[str] = []
    done = lanes.run_parallel(["bad", "core"], _sleeper(marks, 0.2), jobs=2, logs=tmp_path / "logs",
                              env=dict(os.environ), cwd=tmp_path, say=said.append, budget_gib=100, poll=0.1)
    codes = {f.suite: f.returncode for f in done}
    assert codes == {"bad": 3, "core": 0}
    assert any(line.startswith("bad: FAILED (exit 3) in ") for line in said)


def test_a_suites_peak_memory_counts_the_processes_it_starts(tmp_path: Path) -> None:
    lanes = _module("lanes")
    # a parent that starts a child holding about 300 MiB: the tree's memory counts the child
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'b = bytearray(300 * 2**20); import time; time.sleep(1.5)'])")
    done = lanes.run_parallel(["core"], lambda _: [sys.executable, "-c", code], jobs=1, logs=tmp_path,
                              env=dict(os.environ), cwd=tmp_path, say=lambda _: None, budget_gib=100, poll=0.2,
                              sample=0.2)
    assert done[0].peak_bytes > 250 * 2**20


def test_memory_is_read_every_sample_seconds_not_every_poll(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a tree's memory is costly (every mapping of every process): the lanes look for ended suites every
    ``poll`` seconds and read memory every ``sample`` seconds only."""
    lanes = _module("lanes")
    reads: list[float] = []
    real = lanes.tree_memory

    def counted(pid, kids=None):  # noqa: ANN001, ANN202 - tree_memory's shape
        reads.append(time.monotonic())
        return real(pid, kids)

    monkeypatch.setattr(lanes, "tree_memory", counted)
    t0 = time.monotonic()
    lanes.run_parallel(["core"], lambda _: [sys.executable, "-c", "import time; time.sleep(2.5)"], jobs=1,
                       logs=tmp_path, env=dict(os.environ), cwd=tmp_path, say=lambda _: None, budget_gib=100,
                       poll=0.05, sample=1.0)
    took = time.monotonic() - t0
    assert 1 <= len(reads) <= took / 1.0 + 1, (len(reads), took)  # not one per poll (about 50)


def test_a_suite_shorter_than_the_sampling_interval_still_gets_its_peak(tmp_path: Path) -> None:
    """A suite's memory is read at the first poll after it starts: one of a few seconds (docs), started after the
    last reading of the suite before it, has a peak too."""
    lanes = _module("lanes")
    code = "b = bytearray(200 * 2**20); import time; time.sleep(1.0)"
    done = lanes.run_parallel(["verl-train", "docs"], lambda _: [sys.executable, "-c", code], jobs=1, logs=tmp_path,
                              env=dict(os.environ), cwd=tmp_path, say=lambda _: None, budget_gib=100, poll=0.3,
                              sample=600)
    assert [f.suite for f in done] == ["verl-train", "docs"]
    assert all(f.peak_bytes > 150 * 2**20 for f in done), [(f.suite, f.peak_bytes) for f in done]


def test_the_job_count_is_checked_where_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _module("dev")
    assert dev._parse_test_args(["core", "-j", "3", "--", "-k", "x"]) == (["core"], ["-k", "x"], 3)
    assert dev._parse_test_args(["--jobs=1"]) == ([], [], 1)
    with pytest.raises(SystemExit, match=r"-j: expected a number of suites to run at once \(1 or more\), got '0'"):
        dev._parse_test_args(["-j", "0"])
    with pytest.raises(SystemExit, match="unknown suite 'nope'"):
        dev._parse_test_args(["nope"])
    monkeypatch.setenv("APERTUS_TEST_JOBS", "two")
    with pytest.raises(SystemExit, match=r"APERTUS_TEST_JOBS='two': expected a whole number"):
        dev.lanes.default_jobs()
    monkeypatch.setenv("APERTUS_TEST_JOBS", "1")
    assert dev.lanes.default_jobs() == 1


def test_two_suites_or_one_per_two_cores_run_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = _module("lanes")
    monkeypatch.delenv("APERTUS_TEST_JOBS", raising=False)
    monkeypatch.setattr(lanes, "memory_gib", lambda: 24.0)
    for cores, jobs in ((1, 1), (2, 2), (4, 2), (7, 3), (16, 4)):
        monkeypatch.setattr(lanes.os, "cpu_count", lambda c=cores: c)
        assert lanes.default_jobs() == jobs, cores
    monkeypatch.setattr(lanes, "memory_gib", lambda: 8.0)
    assert lanes.default_jobs() == 1


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-Python wheel of one module ``name`` (``VALUE = version``), written by hand."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VALUE = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()}"
              f",{len(text.encode())}" for path, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for member, text in files.items():
            whl.writestr(member, text)
    return path


def test_pips_settings_reach_uv_and_uv_installs_from_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environments are built with uv, told this machine's pip settings (here ``PIP_*`` variables: a folder of
    wheels and no index) as its own flags; what it installs imports, and its bytecode is written by the first
    process that imports it, into the suites' bytecode folder, not beside the module."""
    envs = _module("envs")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "apertus_uv_probe", "1.0")
    _wheel(wheels, "apertus_uv_probe", "2.0")
    monkeypatch.delenv("APERTUS_INSTALLER", raising=False)
    assert envs.uv_command() is not None  # uv itself, installed with this machine's settings when it is not yet
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    settings = envs.pip_settings()
    assert settings["find-links"] == str(wheels) and settings["no-index"] == "1"
    uv = envs.uv_command()
    assert uv is not None and Path(uv[0]).name == "uv"
    assert uv[uv.index("--find-links") + 1] == str(wheels) and "--no-index" in uv and "--compile-bytecode" not in uv
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    req = tmp_path / "requirements.txt"
    req.write_text("apertus_uv_probe>=1\n")
    envs.ROOT = tmp_path  # the log names the requirements file relative to the checkout
    envs.install_requirements(venv / "bin" / "python", req)
    probe = "import apertus_uv_probe, pathlib; print(apertus_uv_probe.VALUE, pathlib.Path(apertus_uv_probe.__file__).parent)"
    envs.PYCACHE = tmp_path / "pycache"
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # set where the tests run: the suites write bytecode anyway
    env = envs.suite_env("core", venv)
    done = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True,
                          env=env)
    version, folder = done.stdout.split()
    assert version == "2.0"  # the newest release
    assert not (Path(folder) / "__pycache__").exists()
    assert list((tmp_path / "pycache").glob(f"**/{Path(folder).name}/__init__.cpython-*.pyc"))


def test_the_setting_pip_would_use_wins_and_uv_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    envs = _module("envs")
    listed = ("global.extra-index-url='file:///a file:///b'\nglobal.find-links='/global'\n:env:.find-links='/env'\n"
              "user.constraint='/c.txt'\nsite.constraint='/site.txt'\nnot a setting\n")

    def run(cmd, **kwargs):  # noqa: ANN001, ANN202 - subprocess.run's shape
        assert cmd[1:] == ["-m", "pip", "config", "list"]
        return subprocess.CompletedProcess(cmd, 0, stdout=listed, stderr="")

    monkeypatch.setattr(envs.subprocess, "run", run)
    assert envs.pip_settings() == {"extra-index-url": "file:///a file:///b", "find-links": "/env",
                                   "constraint": "/site.txt"}
    monkeypatch.setenv("APERTUS_INSTALLER", "pip")
    assert envs.uv_command() is None


def test_requirements_uv_cannot_install_are_installed_by_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    envs = _module("envs")
    envs.ROOT = tmp_path
    calls: list[list[str]] = []

    def run(cmd, **kwargs):  # noqa: ANN001, ANN202 - subprocess.run's shape
        calls.append(list(cmd))
        failed = cmd[0] == "/uv"
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, stdout="", stderr="no solution" if failed else "")

    monkeypatch.setattr(envs, "uv_command", lambda settings=None: ["/uv", "pip", "install"])
    monkeypatch.setattr(envs, "pip_settings", lambda: {})
    monkeypatch.setattr(envs.subprocess, "run", run)
    envs.install_requirements(tmp_path / "bin" / "python", tmp_path / "requirements.txt")
    assert [c[0] for c in calls] == ["/uv", str(tmp_path / "bin" / "python")]
    assert calls[1][1:4] == ["-m", "pip", "install"] and calls[1][-2:] == ["-r", str(tmp_path / "requirements.txt")]
    assert "uv could not install requirements.txt (exit 1), pip tries: no solution" in capsys.readouterr().out
