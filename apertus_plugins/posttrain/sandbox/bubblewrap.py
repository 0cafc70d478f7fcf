"""The local sandbox: Debian's ``bubblewrap`` (``bwrap``) for isolation, ``prlimit`` for resource limits.

Every run is a fresh ``bwrap`` process (one run = one program on one input):

* **namespaces** (``--unshare-all --unshare-user``): a new user namespace (no capabilities outside it;
  ``--disable-userns`` forbids nesting another), a new PID namespace (the program sees only its own
  processes: it cannot signal the trainer, and when the sandbox's init dies every process in it dies),
  a new network namespace (only a loopback device of its own: no route to the host's services or the
  internet), new IPC, UTS and cgroup namespaces.
* **filesystem**: an empty root, read-only; ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` links or
  directories) bound read-only, so the interpreter and the standard library are there and nothing else
  of the host is (no ``/home``, ``/root``, ``/etc``, ``/tmp``, no checkpoints, no data); a fresh ``/proc`` of
  the PID namespace; a minimal ``/dev`` (null, zero, random, urandom, tty), remounted read-only; one
  writable scratch directory, ``/sandbox`` (a size-limited tmpfs, the working directory, gone after the
  run), holding the program as a read-only file.
* **limits** (``prlimit`` from util-linux, applied inside the sandbox): address space per process
  (``RLIMIT_AS``), CPU seconds (``RLIMIT_CPU``), processes and threads (``RLIMIT_NPROC``, counted in the
  sandbox's own user namespace, so concurrent sandboxes do not share the count), file size
  (``RLIMIT_FSIZE``), open files, no core dumps; the wall clock and the output size are enforced by this
  process, which kills the sandbox (``SIGKILL`` to ``bwrap``; ``--die-with-parent`` takes its init and
  with it the whole PID namespace).
* **identity**: the environment is cleared; run as root, the sandbox is started as ``nobody`` (uid and
  gid 65534, no supplementary groups): the kernel does not apply ``RLIMIT_NPROC`` to root, and an
  unprivileged uid owns nothing on the host.

Limits of this isolation (say so wherever it matters): the kernel is shared (no seccomp filter narrows
the system calls; a kernel bug reachable from an unprivileged user namespace is reachable from here);
memory is limited per process, so a program's total is at most ``processes x memory_mb`` (plus the
scratch tmpfs); CPU time is not shared fairly between concurrent sandboxes (``max_concurrent`` bounds
how many run at once). For untrusted code at scale, run the reward workers in a container with a hard
memory limit, or point the reward at a SandboxFusion server (:mod:`verl_ext.sandbox_fusion`).

Needs ``bwrap`` (Debian/Ubuntu package ``bubblewrap``, 0.8 or later), ``prlimit`` (``util-linux``), a
kernel that allows unprivileged user namespaces, and a Python interpreter under ``/usr`` readable by the
sandbox's user (``/usr/bin/python3`` by default: a clean standard library, none of the trainer's
packages). :meth:`BubblewrapSandbox.check` runs a probe and names whichever is missing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from .runner import CodeRunner, Execution, Limits, SandboxUnavailable

__all__ = ["BubblewrapSandbox", "NOBODY", "default_interpreter"]

#: uid and gid the sandbox runs as when this process is root
NOBODY = 65534

#: where the default interpreter is looked for, in order
INTERPRETERS = ("/usr/bin/python3", "/usr/local/bin/python3")

#: system directories that are bound read-only (a symlink stays a symlink: merged-/usr systems)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

SCRATCH = "/sandbox"
PROGRAM = f"{SCRATCH}/main.py"


def default_interpreter() -> str:
    """The first of :data:`INTERPRETERS` that exists (the system's Python, not the trainer's environment)."""
    for path in INTERPRETERS:
        if os.access(path, os.X_OK):
            return path
    raise SandboxUnavailable(f"no Python interpreter for the sandbox at {' or '.join(INTERPRETERS)}: install "
                             "Debian's python3 (apt-get install python3) or give the sandbox's `python` option")


class BubblewrapSandbox(CodeRunner):
    """Runs Python programs in ``bwrap`` with ``prlimit`` limits (see the module docstring for what isolates what).

    Args:
        python: the interpreter inside the sandbox (default :func:`default_interpreter`); it must lie under
            ``/usr`` or under ``extra_ro_binds``, readable by the sandbox's user.
        limits: default :class:`Limits` of a run.
        max_concurrent: runs at once in this process (further callers wait); default: the CPU count.
        extra_ro_binds: more host directories bound read-only at the same path (an interpreter with
            packages, e.g. ``/opt/conda``).
        bwrap / prlimit: the tools (looked up on ``PATH`` by default).
    """

    name = "bubblewrap"

    def __init__(self, python: str | None = None, limits: Limits | None = None, max_concurrent: int | None = None,
                 extra_ro_binds: tuple[str, ...] | list[str] = (), bwrap: str | None = None,
                 prlimit: str | None = None) -> None:
        self.python = python
        self.limits = limits or Limits()
        self.max_concurrent = int(max_concurrent or os.cpu_count() or 1)
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.extra_ro_binds = tuple(str(Path(p)) for p in extra_ro_binds)
        self._bwrap = bwrap
        self._prlimit = prlimit
        self._slots = threading.BoundedSemaphore(self.max_concurrent)
        self._checked = False
        self._check_lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def _tools(self) -> tuple[str, str, str]:
        bwrap = self._bwrap or shutil.which("bwrap")
        if not bwrap or not os.access(bwrap, os.X_OK):
            raise SandboxUnavailable("the code sandbox needs bubblewrap's `bwrap`, which is not installed: "
                                     "apt-get install bubblewrap (or configure a SandboxFusion server)")
        prlimit = self._prlimit or shutil.which("prlimit") or "/usr/bin/prlimit"
        if not os.access(prlimit, os.X_OK):
            raise SandboxUnavailable("the code sandbox needs util-linux's `prlimit`: apt-get install util-linux")
        python = self.python or default_interpreter()
        if not os.access(python, os.X_OK):
            raise SandboxUnavailable(f"the sandbox's interpreter {python} does not exist or is not executable")
        return bwrap, os.path.realpath(prlimit), python

    def _binds(self, paths: tuple[str, ...]) -> list[str]:
        args: list[str] = []
        for d in SYSTEM_DIRS:
            p = Path(d)
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), d]
            elif p.is_dir():
                args += ["--ro-bind", d, d]
        for extra in self.extra_ro_binds:
            args += ["--ro-bind", extra, extra]
        bound = (*SYSTEM_DIRS, *self.extra_ro_binds)
        for path in paths:
            if not any(path == root or path.startswith(root.rstrip("/") + "/") for root in bound):
                raise SandboxUnavailable(f"{path} is not under a directory the sandbox binds ({', '.join(bound)}); "
                                         "add its prefix to extra_ro_binds")
        return args

    def command(self, limits: Limits, program_fd: int, status_fd: int) -> list[str]:
        """The ``bwrap ... prlimit ... python main.py`` command line of one run."""
        bwrap, prlimit, python = self._tools()
        cpu = max(1, math.ceil(limits.time_s))
        return [
            bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--hostname", "sandbox",
            *self._binds((prlimit, python, os.path.realpath(python))),
            "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
            "--size", str(limits.scratch_mb << 20), "--tmpfs", SCRATCH,
            "--ro-bind-data", str(program_fd), PROGRAM,
            "--chdir", SCRATCH, "--remount-ro", "/",
            "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", SCRATCH,
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONIOENCODING", "utf-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONHASHSEED", "0",
            "--json-status-fd", str(status_fd),
            "--", prlimit, f"--as={limits.memory_mb << 20}", f"--cpu={cpu}:{cpu + 1}",
            f"--nproc={limits.processes}", f"--fsize={limits.file_bytes}", f"--nofile={limits.open_files}",
            "--core=0", "--", python, "-s", PROGRAM,
        ]

    def check(self) -> None:
        """Run a probe program once; raise :class:`SandboxUnavailable` naming what is missing."""
        with self._check_lock:
            if self._checked:
                return
            self._tools()
            out = self._run("import sys\nprint(sum(range(10)), sys.version_info[0])", "", Limits(time_s=30))
            if out.status != "ok" or out.stdout.split() != ["45", "3"]:
                why = (out.detail or out.stderr).strip()[-800:]
                hint = ""
                if "namespace" in why or "uid map" in why or "Operation not permitted" in why:
                    hint = (" (bubblewrap needs unprivileged user namespaces: sysctl kernel.unprivileged_userns_clone=1 "
                            "or user.max_user_namespaces > 0; in a container, allow unshare/clone of user namespaces)")
                raise SandboxUnavailable(f"the code sandbox cannot run a probe program ({out.status}, exit "
                                         f"{out.exit_code}): {why}{hint}")
            self._checked = True

    # ------------------------------------------------------------------ running
    def run(self, program: str, stdin: str = "", limits: Limits | None = None) -> Execution:
        self.check()
        return self._run(program, stdin, limits or self.limits)

    def _run(self, program: str, stdin: str, limits: Limits) -> Execution:
        with self._slots:
            try:
                return self._run_once(program, stdin, limits)
            except SandboxUnavailable:
                raise
            except OSError as exc:  # fork/pipe failures of this process: the sandbox could not start
                return Execution("sandbox_error", detail=f"could not start the sandbox: {exc}")

    def _run_once(self, program: str, stdin: str, limits: Limits) -> Execution:
        program_fd = os.memfd_create("program", 0)
        status_r, status_w = os.pipe()
        proc = None
        try:
            os.write(program_fd, program.encode("utf-8", errors="replace"))
            os.lseek(program_fd, 0, os.SEEK_SET)
            cmd = self.command(limits, program_fd, status_w)
            drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(program_fd, status_w), start_new_session=True, env={}, **drop)
            os.close(status_w)
            status_w = -1
            os.close(program_fd)
            program_fd = -1
            out, err, ended = _communicate(proc, stdin.encode("utf-8", errors="replace"), t0 + limits.time_s,
                                           limits.output_bytes)
            seconds = time.monotonic() - t0
            status_text = _read_all(status_r)
        finally:
            for fd in (program_fd, status_w):
                if fd >= 0:
                    os.close(fd)
            if proc is not None:
                _kill(proc)
            os.close(status_r)
        return _classify(proc.returncode, out, err, ended, status_text, seconds, limits)


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        data = os.read(fd, 65536)
        if not data:
            return b"".join(chunks).decode("utf-8", errors="replace")
        chunks.append(data)


def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, str]:
    """Feed stdin, collect stdout/stderr until both close; stop at the deadline or past ``cap`` bytes.

    Returns ``(stdout, stderr, how)`` with ``how`` one of ``exited``, ``timeout``, ``output_limit``.
    """
    assert proc.stdin and proc.stdout and proc.stderr

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            for i in range(0, len(stdin), 65536):
                proc.stdin.write(stdin[i:i + 65536])
            proc.stdin.close()

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        sel.register(f, selectors.EVENT_READ)
    how = "exited"
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                how = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                bufs[key.fd] += data
            if sum(len(b) for b in bufs.values()) > cap:
                how = "output_limit"
                break
        if how == "exited":
            try:
                proc.wait(max(0.0, deadline - time.monotonic()) + 1.0)
            except subprocess.TimeoutExpired:
                how = "timeout"
    finally:
        sel.close()
    if how != "exited":
        _kill(proc)
    writer.join(timeout=5)
    return bytes(bufs[out_fd][:cap]), bytes(bufs[err_fd][:cap]), how


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``bwrap`` (its process group); ``--die-with-parent`` takes the sandbox's PID namespace with it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


def _classify(returncode: int | None, out: bytes, err: bytes, how: str, status_text: str, seconds: float,
              limits: Limits) -> Execution:
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    exit_code = None
    info: dict[str, int] = {}
    for line in status_text.splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if "exit-code" in rec:
                exit_code = int(rec["exit-code"])
            if "pid-namespace" in rec:
                info["pid_namespace"] = int(rec["pid-namespace"])
    run = _status(returncode, stdout, stderr, how, exit_code, seconds, limits)
    run.info.update(info)
    return run


def _status(returncode: int | None, stdout: str, stderr: str, how: str, exit_code: int | None, seconds: float,
            limits: Limits) -> Execution:
    if how == "timeout":
        return Execution("timeout", stdout, stderr, seconds=seconds,
                         detail=f"killed after {limits.time_s:g} s of wall-clock time")
    if how == "output_limit":
        return Execution("output_limit", stdout, stderr, seconds=seconds,
                         detail=f"wrote more than {limits.output_bytes} bytes to stdout and stderr")
    if exit_code is None:  # bwrap stopped before the program ran
        return Execution("sandbox_error", stdout, stderr, exit_code=returncode, seconds=seconds,
                         detail=f"bwrap exited with {returncode} before the program ran: {stderr.strip()[-500:]}")
    sig = exit_code - 128 if exit_code > 128 else None
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if exit_code == 0:
        return Execution("ok", stdout, stderr, exit_code=0, seconds=seconds)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and seconds >= 0.9 * math.ceil(limits.time_s)):
        return Execution("timeout", stdout, stderr, exit_code, sig, seconds,
                         f"CPU time limit ({math.ceil(limits.time_s)} s)")
    if sig == signal.SIGXFSZ or "No space left on device" in stderr or "File too large" in stderr:
        return Execution("file_limit", stdout, stderr, exit_code, sig, seconds,
                         f"file size limit ({limits.file_bytes} bytes) or full scratch directory "
                         f"({limits.scratch_mb} MiB)")
    if "MemoryError" in tail or "Cannot allocate memory" in stderr or "MemoryError" in stderr[-2000:]:
        return Execution("memory_limit", stdout, stderr, exit_code, sig, seconds,
                         f"address space limit ({limits.memory_mb} MiB)")
    detail = f"killed by signal {signal.Signals(sig).name}" if sig and sig in signal.valid_signals() else (
        f"exit status {exit_code}")
    return Execution("runtime_error", stdout, stderr, exit_code, sig, seconds, f"{detail}: {tail[-300:]}")
