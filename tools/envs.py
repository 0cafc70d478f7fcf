"""The suites' virtual environments: built once per requirements, cached outside the clone.

Each suite lives in ``tests/<suite>/`` with a ``requirements.txt``. Its virtual environment is
kept outside the clone, in ``$APERTUS_VENV_CACHE`` (default ``~/.cache/apertus-plugins/venvs``),
under a name keyed by a hash of the requirements, so a fresh clone reuses environments that are
already built and a changed requirements file gets a new one. The package's metadata (console
scripts, entry points) is installed into the environment from this checkout (editable, no
dependencies) when it changes. The requirements are installed with uv when it can be had (installed with
pip once, into its own environment in the cache; :func:`install_requirements`), told this machine's pip
settings, without bytecode (each module the suites import is compiled once, into ``PYCACHE``), and with pip
where uv is turned off (``APERTUS_INSTALLER=pip``) or fails; the code under test is this checkout's, through ``PYTHONPATH``.
A suite that also uses another suite's environment (a test that starts a vLLM server) names it
in ``tests/<suite>/needs.txt``; its interpreter is passed as ``APERTUS_PYTHON_<SUITE>`` (``-``
becomes ``_``). A suite whose ``tests/<suite>/python.txt`` says ``3.12`` gets its environment from
``python3.12`` (on PATH, or under pyenv's ``versions/`` when the PATH entry is a shim that does not
run), else from the interpreter running this script. The suites run with ``HF_HUB_OFFLINE=1``
unless it is set: Hub ids are read from the Hugging Face cache only, and nothing tries to reach a
model hub.

System packages: a suite whose tests run a program that no Python environment holds (the core
suite's headless Chromium) lists its Debian packages in ``tests/<suite>/debian.txt``, one a line
(``#`` comments). Before the suite runs, each one ``dpkg-query`` does not report installed is
installed with ``apt-get install -y`` (after an ``apt-get update`` when the first try fails); when
that is not possible (no apt-get, not root, no registry) the command stops with an error naming the
suite, the packages and the apt-get output.

Building ahead: ``python3 tools/envs.py prebuild SUITE...`` builds the environments of those suites (and of
the suites they need) one after the other; ``tools/dev.py test`` starts it in the background, at the lowest
CPU and I/O priority, so that the environments of the later suites are built while the earlier suites run.
It takes the same per-environment lock as a session, so a session that reaches an environment the
background build is still writing waits for it, and one the background build has not reached yet is built
by the session itself (the background build then finds it complete).

Used by ``noxfile.py`` (the test sessions) and ``tools/dev.py`` (the bootstrap); standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
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
#: ``docs`` builds the documentation site (warnings are errors) and checks its links.
SUITES = ["docs", "core", "reference", "megatron", "megatron-train", "megatron-bridge", "vllm", "verl", "verl-train", "eval"]
#: The bytecode of the modules the suites import (``PYTHONPYCACHEPREFIX``): the environments are installed without
#: it, and each module is compiled once, by the first process that imports it.
PYCACHE = CACHE / "pycache"
#: Where each suite's pytest writes its JUnit XML report (``<suite>.xml``): the summary reads them
#: (``$APERTUS_TEST_REPORTS`` moves them).
REPORTS = Path(os.environ.get("APERTUS_TEST_REPORTS", ROOT / "build" / "test-reports"))


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def _runs(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import sys"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def base_python() -> str:
    """The interpreter the suites' environments come from when they name none: the one that runs
    ``tools/dev.py`` (passed to nox as ``APERTUS_BASE_PYTHON``), else this process's base interpreter
    (the one a virtual environment was made from), so the cache keys do not depend on a venv."""
    return os.environ.get("APERTUS_BASE_PYTHON") or getattr(sys, "_base_executable", None) or sys.executable


def suite_python(suite: str) -> str:
    """The interpreter of a suite: ``python<X.Y>`` from ``tests/<suite>/python.txt``, else this one.

    A ``python3.12`` on PATH may be a pyenv shim that refuses to run while another version is the
    selected one; then the interpreter under pyenv's ``versions/`` folder is taken.
    """
    marker = TESTS / suite / "python.txt"
    if not marker.is_file():
        return base_python()
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
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process (the background build, another checkout) holds it: say so
            log(f"waiting for {path.name.lstrip('.').removesuffix('.lock')}: another process is building it")
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
    # another process (a second checkout's test run, the system's own updates) may hold dpkg's lock: wait for it
    wait = ["-o", "DPkg::Lock::Timeout=900"]
    install = [*sudo, "apt-get", *wait, "install", "-y", "-q", *missing]
    log(f"{suite}: installing Debian packages {' '.join(missing)} (tests/{suite}/debian.txt)")
    t0 = time.time()
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # a stale or missing package list: refresh it once and try again
        subprocess.run([*sudo, "apt-get", *wait, "update", "-q"], env=env, capture_output=True, text=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
    still = [p for p in missing if not _installed(p)]
    if done.returncode != 0 or still:
        raise SystemExit(f"suite {suite} needs the Debian packages {' '.join(still or missing)} "
                         f"(tests/{suite}/debian.txt), and `{' '.join(install)}` failed (exit {done.returncode}):\n"
                         + (done.stdout + done.stderr)[-2000:])
    log(f"{suite}: Debian packages ready in {time.time() - t0:.0f}s")


#: The installer the environments are built with when it can be had (``APERTUS_INSTALLER=pip`` turns it off):
#: uv resolves the versions pip resolves and downloads and installs them in parallel, several times faster than
#: pip from an empty cache (vllm's environment: 40 s against 112 s on 2 cores, 15 s without bytecode).
UV_REQUIREMENT = "uv==0.13.10"
#: pip settings (``pip config list``: its files and ``PIP_*`` variables) uv is told about, as its own flags.
_PIP_TO_UV = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
              "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}


def pip_settings() -> dict[str, str]:
    """This machine's pip settings, the one pip itself would use for each key (``PIP_*`` variables over the
    site, user and global files)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    rank = {":env:": 0, "site": 1, "user": 2, "global": 3}
    best: dict[str, tuple[int, str]] = {}
    for line in listed.stdout.splitlines():
        name, sep, value = line.partition("=")
        scope, dot, key = name.rpartition(".")
        if not sep or not dot:
            continue
        value = value.strip().strip("'\"")
        order = rank.get(scope, 4)
        if key not in best or order < best[key][0]:
            best[key] = (order, value)
    return {key: value for key, (_, value) in best.items()}


def uv_command(settings: dict[str, str] | None = None) -> list[str] | None:
    """uv with this machine's pip settings (``settings``, else :func:`pip_settings`) as flags, from its own small
    environment in the cache (installed with pip the first time); None when ``APERTUS_INSTALLER=pip`` or uv cannot
    be installed (pip builds then)."""
    if os.environ.get("APERTUS_INSTALLER", "uv") == "pip":
        return None
    # one per uv release: only its binary is used, whatever interpreter the environment was made with
    venv = CACHE / f"uv-{hashlib.sha256(UV_REQUIREMENT.encode()).hexdigest()[:16]}"
    with _locked(CACHE / f".{venv.name}.lock"):
        if not (venv / ".complete").is_file():
            shutil.rmtree(venv, ignore_errors=True)
            made = subprocess.run([base_python(), "-m", "venv", str(venv)], capture_output=True, text=True)
            if made.returncode == 0:
                made = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                                       "--disable-pip-version-check", UV_REQUIREMENT], capture_output=True, text=True)
            if made.returncode != 0:
                log(f"{UV_REQUIREMENT} could not be installed, pip builds the environments: "
                    f"{(made.stdout + made.stderr).strip()[-300:]}")
                return None
            (venv / ".complete").write_text("ok\n")
    # no --compile-bytecode: compiling every module of torch, vLLM and transformers costs more than the whole
    # install (vllm's environment: 46 s of CPU for 22,640 files, against 3 s to install from uv's cache); the
    # suites compile the modules they import once, into PYCACHE (:func:`suite_env`), about one in eight
    cmd = [str(venv / "bin" / "uv"), "pip", "install", "--quiet",
           # pip looks for each package on every index and takes the best version: so does uv with this
           "--index-strategy", "unsafe-best-match"]
    settings = pip_settings() if settings is None else settings
    for key, flag in _PIP_TO_UV.items():
        for value in settings.get(key, "").split():
            cmd += [flag, value]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        cmd.append("--no-index")
    return cmd


def install_requirements(py: Path, req: Path) -> None:
    """Install ``req`` into the environment of ``py``: with uv (:func:`uv_command`), else with pip; when uv
    fails, pip tries again (its error is logged), so an environment uv cannot build still gets built."""
    settings = pip_settings()  # read once: `pip config list` is a Python process of its own
    uv = uv_command(settings)
    if uv is not None:
        env = dict(os.environ)
        cert = settings.get("cert")
        if cert and "SSL_CERT_FILE" not in env:  # the certificate bundle pip is told to trust, for uv too
            env["SSL_CERT_FILE"] = cert
        done = subprocess.run([*uv, "--python", str(py), "-r", str(req)], env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return
        log(f"uv could not install {req.relative_to(ROOT)} (exit {done.returncode}), pip tries: "
            f"{(done.stdout + done.stderr).strip()[-1500:]}")
    subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r", str(req)],
                   check=True)


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
            install_requirements(py, req)
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

    ``PYTHONPATH`` puts this checkout first; ``PYTHONPYCACHEPREFIX`` keeps the bytecode of every module the
    suites import (the environments' and this checkout's) in :data:`PYCACHE`, outside the clone, compiled by
    the first process that imports it; ``APERTUS_PYTHON_<SUITE>`` names the interpreter of
    each environment the suite needs (``tests/<suite>/needs.txt``), for tests that start a
    process in another environment (a vLLM server, the reference port); ``APERTUS_EXCHANGE`` is a
    folder shared by the suites of one run.
    """
    env = dict(os.environ, APERTUS_SUITE=suite, PYTHONPYCACHEPREFIX=str(PYCACHE))
    # bytecode is written, outside the clone: the modules a suite imports are compiled once, not in every process
    # (empty, not removed: nox lays this environment over its own, which may set it; Python reads "" as unset)
    env["PYTHONDONTWRITEBYTECODE"] = ""
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


def build_order(suites: list[str]) -> list[str]:
    """The environments ``suites`` run in, in the order their sessions first need them, each once (a suite's
    own environment first, then those of ``needs.txt``, which its session builds before pytest starts)."""
    order: list[str] = []
    for suite in suites:
        for name in (suite, *needed_suites(suite)):
            if name not in order:
                order.append(name)
    return order


def prebuild(suites: list[str]) -> int:
    """Build the environments of ``suites`` (:func:`build_order`), one at a time; return how many failed.

    A failure is logged and the next environment is tried: the session of that suite builds it again and
    reports the error where it belongs.
    """
    failed = 0
    for name in build_order(suites):
        t0 = time.time()
        try:
            build_env(name)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - the session rebuilds it and reports the error
            failed += 1
            log(f"prebuild: {name} failed after {time.time() - t0:.0f}s ({err}); its session builds it again")
            continue
        log(f"prebuild: {name} ready ({time.time() - t0:.0f}s)")
    return failed


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "prebuild":
        raise SystemExit("usage: envs.py prebuild SUITE...")
    unknown = [s for s in sys.argv[2:] if s not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {', '.join(unknown)}; suites are {', '.join(SUITES)}")
    sys.exit(1 if prebuild(sys.argv[2:]) else 0)
