#!/usr/bin/env python3
"""Set up and run everything on a fresh machine (Python 3.11 and the standard library are enough).

    python3 tools/dev.py demo                   # the main job, in the `core` environment
    python3 tools/dev.py test                   # build every suite's environment and run every suite
    python3 tools/dev.py test core reference    # only some suites
    python3 tools/dev.py test core -- -k vocab  # arguments after `--` go to pytest (`-k NAME`, -x)
    python3 tools/dev.py test vllm -- tests/vllm/test_parsers.py  # a file or node id: that alone
    python3 tools/dev.py test -j 1              # one suite at a time (default: 2, one per 2 cores on more)
    python3 tools/dev.py env SUITE              # build one environment and print its path
    python3 tools/dev.py run SUITE CMD...       # run a command in a suite's environment

``test`` is nox: it builds a small environment holding nox (``tools/requirements.txt``, cached
beside the suites' environments) and runs the sessions of ``noxfile.py``, one per suite; the
summary is read from the JUnit XML reports pytest writes (``build/test-reports/<suite>.xml``).
While the first suites run, the environments of the later ones are built in the background at the lowest
CPU and I/O priority (``tools/envs.py prebuild``, its log in ``build/test-reports/prebuild.log``;
``APERTUS_PREBUILD=0`` turns it off). Suites run side by side (two, or one per 2 cores on a larger machine;
``-j N``), the longest first and within a memory budget, each one's output in
``build/test-reports/<suite>.log`` (``tools/lanes.py``). How the suites' environments are built and cached: ``tools/envs.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import lanes
from envs import CACHE, REPORTS, ROOT, SUITES, _locked, build_env, build_order, ensure_debian_packages, log, suite_env

TOOLS_REQUIREMENTS = ROOT / "tools" / "requirements.txt"


def nox_env() -> Path:
    """The environment that holds nox, keyed by ``tools/requirements.txt`` and this interpreter."""
    key = hashlib.sha256(TOOLS_REQUIREMENTS.read_bytes() + sys.executable.encode()).hexdigest()[:16]
    venv = CACHE / f"tools-{key}"
    with _locked(CACHE / f".{venv.name}.lock"):
        if not (venv / ".complete").is_file():
            shutil.rmtree(venv, ignore_errors=True)
            log(f"tools: creating {venv} (nox)")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                            "-q", "-r", str(TOOLS_REQUIREMENTS)], check=True)
            (venv / ".complete").write_text("ok\n")
    return venv


def junit_counts(report: Path) -> tuple[int, int, int, int, float] | None:
    """``(passed, failed, errors, skipped, seconds)`` from a pytest JUnit XML report, or None when there is none."""
    if not report.is_file():
        return None
    try:
        root = ET.parse(report).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = failed = errors = skipped = 0
    seconds = 0.0
    for s in suites:
        tests += int(s.get("tests", 0))
        failed += int(s.get("failures", 0))
        errors += int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
        seconds += float(s.get("time", 0) or 0)
    return tests - failed - errors - skipped, failed, errors, skipped, seconds


def start_prebuild(suites: list[str], env: dict[str, str], jobs: int = 1) -> subprocess.Popen[bytes] | None:
    """Build the environments of ``suites`` (in the order they start) but those of the first ``jobs`` (their
    sessions build them at once) in a background process (``envs.py prebuild``), at the lowest CPU and I/O
    priority, its output in ``prebuild.log`` beside the reports; None when there is nothing to build ahead or
    ``APERTUS_PREBUILD=0``."""
    ahead = [name for name in build_order(suites) if name not in suites[:jobs]]
    if not ahead or os.environ.get("APERTUS_PREBUILD", "1") == "0":
        return None
    REPORTS.mkdir(parents=True, exist_ok=True)
    low = ["nice", "-n", "19"] if shutil.which("nice") else []
    low += ["ionice", "-c", "3"] if shutil.which("ionice") else []
    with open(REPORTS / "prebuild.log", "wb") as out:
        proc = subprocess.Popen([*low, sys.executable, str(ROOT / "tools" / "envs.py"), "prebuild", *ahead],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    log(f"building the environments of {', '.join(ahead)} in the background ({REPORTS / 'prebuild.log'})")
    return proc


def stop_prebuild(proc: subprocess.Popen[bytes] | None) -> None:
    """End the background build (its process group) if the sessions finished first; an environment it left
    unfinished has no ``.complete`` and is rebuilt by the next run that needs it."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _parse_test_args(args: list[str]) -> tuple[list[str], list[str], int | None]:
    """``[SUITE...] [-j N | --jobs N] [-- PYTEST ARGS]``: the suites, pytest's arguments and the job count."""
    pytest_args: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, pytest_args = args[:cut], args[cut + 1 :]
    suites: list[str] = []
    jobs: int | None = None
    it = iter(args)
    for a in it:
        if a in ("-j", "--jobs") or a.startswith("--jobs="):
            value = a.split("=", 1)[1] if "=" in a else next(it, None)
            if value is None or not value.isdigit() or int(value) < 1:
                raise SystemExit(f"{a}: expected a number of suites to run at once (1 or more), got {value!r}")
            jobs = int(value)
        elif a not in SUITES:
            raise SystemExit(f"unknown suite {a!r}; suites are {', '.join(SUITES)}")
        else:
            suites.append(a)
    return suites, pytest_args, jobs


def cmd_test(args: list[str]) -> int:
    """``test [SUITE...] [-j N] [-- PYTEST ARGS]``: the suites' nox sessions, then a summary from their reports."""
    suites, pytest_args, jobs = _parse_test_args(args)
    suites = suites or list(SUITES)
    jobs = min(jobs or lanes.default_jobs(), len(suites))
    for s in suites:  # a report left from an earlier run must not stand for this one
        (REPORTS / f"{s}.xml").unlink(missing_ok=True)
    nox = nox_env() / "bin" / "nox"

    def command(*names: str) -> list[str]:
        cmd = [str(nox), "-f", str(ROOT / "noxfile.py"), "-s", *names]
        return cmd + ["--", *pytest_args] if pytest_args else cmd

    started = time.monotonic()
    # the sessions and the background build must compute the same environment keys: the same base interpreter
    env = dict(os.environ, APERTUS_BASE_PYTHON=sys.executable)
    # the environments are built ahead in the order the suites start: the lanes' (the longest first)
    prebuild = start_prebuild(suites if jobs == 1 else lanes.start_order(suites), env, jobs)
    finished: dict[str, lanes.Finished] = {}
    try:
        if jobs == 1:
            rc = subprocess.call(command(*suites), cwd=ROOT, env=env)
        else:
            log(f"running {len(suites)} suites, {jobs} at a time (-j/--jobs, $APERTUS_TEST_JOBS)")
            done = lanes.run_parallel(suites, command, jobs=jobs, logs=REPORTS, env=env, cwd=ROOT, say=log)
            finished = {f.suite: f for f in done}
            rc = max((f.returncode for f in done), default=0)
            for f in done:
                if f.returncode:
                    print(f"\n==== {f.suite}: the end of its output ({f.log}) ====")
                    print(lanes.tail(f.log))
    finally:
        stop_prebuild(prebuild)
    wall = time.monotonic() - started
    print("\n==== suites (time: pytest's own, environments not counted) ====")
    total_p = total_f = 0
    for s in suites:
        counts = junit_counts(REPORTS / f"{s}.xml")
        if counts is None:
            print(f"{s:15s} FAILED  no report (the environment or the session failed before pytest ran)")
            total_f += 1
            continue
        p, f, e, k, secs = counts
        status = "ok" if not (f or e) else "FAILED"
        extra = ""
        if s in finished:
            extra = f"   wall {finished[s].seconds / 60:5.1f} min, peak {finished[s].peak_bytes / 2**30:4.1f} GiB"
        print(f"{s:15s} {status:6s} {p:5d} passed {f:3d} failed {e:3d} errors {k:3d} skipped {secs / 60:6.1f} min{extra}")
        total_p += p
        total_f += f + e
    print(f"all suites, environments included: {wall / 60:.1f} min ({jobs} at a time)")
    print(f"{total_p} passed, {total_f} failed (nox exit {rc})")
    return 1 if rc or total_f else 0


def cmd_demo(args: list[str]) -> int:
    venv = build_env("core")
    serve = "--no-serve" not in args
    args = [a for a in args if a != "--no-serve"]
    rc = subprocess.call([str(venv / "bin" / "apertus"), "demo", *args], env=suite_env("core", venv))
    if rc or not serve:
        return rc
    # the serving step: a small random checkpoint in the released layout, served by vLLM with the plugin
    vllm = build_env("vllm")
    tmp = Path(tempfile.mkdtemp(prefix="apertus-demo-"))
    ckpt = tmp / "checkpoint"
    env = suite_env("vllm", vllm)
    try:
        rc = subprocess.call([str(vllm / "bin" / "apertus"), "make-checkpoint", str(ckpt)], env=env)
        if rc:
            return rc
        # the same conversation again, its codes computed by the checkpoint's encoders, then served
        return subprocess.call([str(vllm / "bin" / "apertus"), "demo", "--checkpoint", str(ckpt), "--serve", str(ckpt)],
                               env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_run(args: list[str]) -> int:
    """``run SUITE COMMAND...``: a command inside a suite's environment (benchmarks, one test file)."""
    if len(args) < 2:
        raise SystemExit("usage: dev.py run SUITE COMMAND [ARGS...]")
    suite, cmd = args[0], args[1:]
    if suite not in SUITES:
        raise SystemExit(f"unknown suite {suite!r}; suites are {', '.join(SUITES)}")
    ensure_debian_packages(suite)
    venv = build_env(suite)
    return subprocess.call(cmd, env=suite_env(suite, venv), cwd=ROOT)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "test":
        return cmd_test(rest)
    if cmd == "demo":
        return cmd_demo(rest)
    if cmd == "env":
        print(build_env(rest[0]))
        return 0
    if cmd == "run":
        return cmd_run(rest)
    raise SystemExit(f"unknown command {cmd!r}; see --help")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
