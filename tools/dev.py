#!/usr/bin/env python3
"""Set up and run everything on a fresh machine: the demo and the test suites.

    python3 tools/dev.py demo     # the main job, in the `core` environment
    python3 tools/dev.py test     # build every suite's environment and run every suite
    python3 tools/dev.py test core reference   # only some suites
    python3 tools/dev.py env SUITE             # build one environment and print its path
    python3 tools/dev.py run SUITE CMD...      # run a command in a suite's environment

Each suite lives in ``tests/<suite>/`` with a ``requirements.txt``. Its virtual environment is
kept outside the clone, in ``$APERTUS_VENV_CACHE`` (default ``~/.cache/apertus-plugins/venvs``),
under a name keyed by a hash of the requirements, so a fresh clone reuses environments that are
already built and a changed requirements file gets a new one. The package's metadata (console
scripts, entry points) is installed into the environment from this checkout (editable, no
dependencies) when it changes; the code under test is this checkout's, through ``PYTHONPATH``.
A suite that also uses another suite's environment (a test that starts a vLLM server) names it
in ``tests/<suite>/needs.txt``; its interpreter is passed as ``APERTUS_PYTHON_<SUITE>`` (``-``
becomes ``_``). A suite whose ``tests/<suite>/python.txt`` says ``3.12`` gets its environment from
``python3.12`` (on PATH, or under pyenv's ``versions/`` when the PATH entry is a shim that does not
run), else from the interpreter running this script. The suites run with ``HF_HUB_OFFLINE=1``
unless it is set: Hub ids are read from the Hugging Face cache only, and nothing tries to reach a
model hub.

System packages: a suite whose tests run a program that no Python environment holds (the core
suite's headless Chromium) lists its Debian packages in ``tests/<suite>/debian.txt``, one a line
(``#`` comments). Before the suite runs (``test`` and ``run``), each one ``dpkg-query`` does not
report installed is installed with ``apt-get install -y`` (after an ``apt-get update`` when the
first try fails); when that is not possible (no apt-get, not root, no registry) the command stops
with an error naming the suite, the packages and the apt-get output.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CACHE = Path(os.environ.get("APERTUS_VENV_CACHE", Path.home() / ".cache" / "apertus-plugins" / "venvs"))
#: Suites in run order; each names the Python it needs (megatron-core 0.19 and lmms-eval need 3.12).
SUITES = ["core", "reference", "megatron", "megatron-train", "vllm", "verl", "verl-train", "eval"]


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def _runs(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import sys"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def suite_python(suite: str) -> str:
    """The interpreter of a suite: ``python<X.Y>`` from ``tests/<suite>/python.txt``, else this one.

    A ``python3.12`` on PATH may be a pyenv shim that refuses to run while another version is the
    selected one; then the interpreter under pyenv's ``versions/`` folder is taken.
    """
    marker = TESTS / suite / "python.txt"
    if not marker.is_file():
        return sys.executable
    want = marker.read_text().strip()
    name = f"python{want}"
    candidates = [shutil.which(name)]
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(str(p) for p in root.glob(f"versions/{want}.*/bin/{name}"))
    for found in candidates:
        if found and _runs(found):
            return found
    raise SystemExit(f"suite {suite} needs {name}, which is not on PATH (nor under {root}/versions)")


def env_key(suite: str) -> str:
    req = TESTS / suite / "requirements.txt"
    h = hashlib.sha256()
    h.update(req.read_bytes())
    h.update(suite_python(suite).encode())
    extra = TESTS / suite / "setup_env.sh"
    if extra.is_file():
        h.update(extra.read_bytes())
    return f"{suite}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (several checkouts may share one environment cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def needed_suites(suite: str) -> list[str]:
    """Suites whose environments this suite's tests also use (``tests/<suite>/needs.txt``)."""
    needs = TESTS / suite / "needs.txt"
    if not needs.is_file():
        return []
    names = [ln.split("#")[0].strip() for ln in needs.read_text().splitlines()]
    return [n for n in names if n]


def debian_packages(suite: str) -> list[str]:
    """The Debian packages ``tests/<suite>/debian.txt`` lists."""
    listing = TESTS / suite / "debian.txt"
    if not listing.is_file():
        return []
    names = [ln.split("#")[0].strip() for ln in listing.read_text().splitlines()]
    return [n for n in names if n]


def _installed(package: str) -> bool:
    probe = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip().endswith("install ok installed")


def ensure_debian_packages(suite: str) -> None:
    """Install the missing packages of ``tests/<suite>/debian.txt`` with apt-get, or stop with a clear error."""
    wanted = debian_packages(suite)
    if not wanted:
        return
    if not shutil.which("dpkg-query") or not shutil.which("apt-get"):
        raise SystemExit(f"suite {suite} needs the Debian packages {' '.join(wanted)} (tests/{suite}/debian.txt), "
                         "and this machine has no dpkg-query/apt-get to install them")
    missing = [p for p in wanted if not _installed(p)]
    if not missing:
        return
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if sudo is None:
        raise SystemExit(f"suite {suite} needs the Debian packages {' '.join(missing)} (tests/{suite}/debian.txt); "
                         f"install them as root: apt-get install -y {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [*sudo, "apt-get", "install", "-y", "-q", *missing]
    log(f"{suite}: installing Debian packages {' '.join(missing)} (tests/{suite}/debian.txt)")
    t0 = time.time()
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # a stale or missing package list: refresh it once and try again
        subprocess.run([*sudo, "apt-get", "update", "-q"], env=env, capture_output=True, text=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
    still = [p for p in missing if not _installed(p)]
    if done.returncode != 0 or still:
        raise SystemExit(f"suite {suite} needs the Debian packages {' '.join(still or missing)} "
                         f"(tests/{suite}/debian.txt), and `{' '.join(install)}` failed (exit {done.returncode}):\n"
                         + (done.stdout + done.stderr)[-2000:])
    log(f"{suite}: Debian packages ready in {time.time() - t0:.0f}s")


def build_env(suite: str) -> Path:
    """Create (or reuse) the suite's environment and install this checkout's metadata into it.

    The checkout is installed editable without dependencies, which registers the console scripts
    and entry points; the tests import the code of the checkout that runs them through
    ``PYTHONPATH`` (see :func:`suite_env`), so several checkouts can share one cached environment.
    """
    req = TESTS / suite / "requirements.txt"
    if not req.is_file():
        raise SystemExit(f"suite {suite!r} has no {req.relative_to(ROOT)}")
    venv = CACHE / env_key(suite)
    py = venv / "bin" / "python"
    done = venv / ".complete"
    with _locked(CACHE / f".{venv.name}.lock"):
        if not done.is_file():
            if venv.exists():
                log(f"{suite}: removing an unfinished environment {venv}")
                shutil.rmtree(venv)
            CACHE.mkdir(parents=True, exist_ok=True)
            log(f"{suite}: creating {venv} (first run; later runs reuse it)")
            t0 = time.time()
            subprocess.run([suite_python(suite), "-m", "venv", str(venv)], check=True)
            pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            subprocess.run(pip + ["-r", str(req)], check=True)
            extra = TESTS / suite / "setup_env.sh"
            if extra.is_file():
                subprocess.run(["bash", str(extra), str(py)], check=True)
            # written last: an interrupted build is detected and redone on the next run
            done.write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
            log(f"{suite}: environment ready in {time.time() - t0:.0f}s")
        stamp = venv / ".installed-from"
        want = f"{ROOT}\n{hashlib.sha256((ROOT / 'pyproject.toml').read_bytes()).hexdigest()}\n"
        if not stamp.is_file() or stamp.read_text() != want:
            subprocess.run(
                [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
                 "--no-build-isolation", "-e", str(ROOT)],
                check=True,
            )
            stamp.write_text(want)
    return venv


def suite_env(suite: str, venv: Path) -> dict[str, str]:
    """The environment a suite's processes run with.

    ``PYTHONPATH`` puts this checkout first; ``APERTUS_PYTHON_<SUITE>`` names the interpreter of
    each environment the suite needs (``tests/<suite>/needs.txt``), for tests that start a
    process in another environment (a vLLM server, the reference port); ``APERTUS_EXCHANGE`` is a
    folder shared by the suites of one run.
    """
    env = dict(os.environ, APERTUS_SUITE=suite, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(venv)
    # Ray 2.60 turns token authentication on for a `ray start` cluster once ~/.ray/auth_token exists (any
    # earlier local ray.init() writes it), and its own `ray status` then cannot connect; the test clusters
    # live on loopback, without it
    env.setdefault("RAY_AUTH_MODE", "disabled")
    # the suites never reach a model hub: a Hub id is read from the Hugging Face cache only (there is
    # no network here, and a test that named a missing path that looks like ORG/NAME must not try one)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("APERTUS_EXCHANGE", str(Path(tempfile.gettempdir()) / f"apertus-exchange-{os.getpid()}"))
    Path(env["APERTUS_EXCHANGE"]).mkdir(parents=True, exist_ok=True)
    env[f"APERTUS_PYTHON_{suite.upper().replace('-', '_')}"] = str(venv / "bin" / "python")
    for other in needed_suites(suite):
        env[f"APERTUS_PYTHON_{other.upper().replace('-', '_')}"] = str(build_env(other) / "bin" / "python")
    return env


SUMMARY = re.compile(r"=+ (.*) in [\d.]+s")


def run_suite(suite: str) -> tuple[str, int, int, int, int]:
    """Run one suite; returns (suite, rc, passed, failed, errors)."""
    ensure_debian_packages(suite)
    venv = build_env(suite)
    tests = sorted(p for p in (TESTS / suite).rglob("test_*.py"))
    if not tests:
        log(f"{suite}: no tests yet (environment builds and imports)")
        check = subprocess.run([str(venv / "bin" / "python"), "-c", "import apertus_plugins"],
                               env=suite_env(suite, venv))
        return suite, check.returncode, 0, 0, 0
    env = suite_env(suite, venv)
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider", str(TESTS / suite)]
    log(f"{suite}: {' '.join(cmd[2:])}")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if SUMMARY.search(line):
            last = line
    rc = proc.wait()
    counts = {k: 0 for k in ("passed", "failed", "error", "errors", "skipped", "xfailed")}
    for n, word in re.findall(r"(\d+) (\w+)", last):
        if word in counts:
            counts[word] += int(n)
    return suite, rc, counts["passed"], counts["failed"], counts["error"] + counts["errors"]


def cmd_test(suites: list[str]) -> int:
    for s in suites:
        if s not in SUITES:
            raise SystemExit(f"unknown suite {s!r}; suites are {', '.join(SUITES)}")
    results = []
    for s in suites or SUITES:
        try:
            results.append(run_suite(s))
        except subprocess.CalledProcessError as exc:
            log(f"{s}: environment setup failed ({exc})")
            results.append((s, 1, 0, 0, 1))
        except SystemExit as exc:  # a suite that cannot be set up (its Debian packages) fails; the others run
            log(f"{s}: {exc}")
            results.append((s, 1, 0, 0, 1))
    print("\n==== suites ====")
    total_p = total_f = 0
    bad = False
    for s, rc, p, f, e in results:
        status = "ok" if rc == 0 else "FAILED"
        bad |= rc != 0
        note = "" if (p or f or e) else "  (no tests yet)"
        print(f"{s:10s} {status:6s} {p:5d} passed {f:3d} failed {e:3d} errors{note}")
        total_p += p
        total_f += f + e
    print(f"{total_p} passed, {total_f} failed")
    return 1 if bad else 0


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
