"""Ray on this machine only: the head a run starts for ``--ray-address local``, and drivers of loopback heads.

``--ray-address local`` starts a Ray head that belongs to the run (:class:`LocalHead`):

* **loopback only.** Ray binds its servers (GCS, raylet, workers, agents) to the node's address,
  or to every interface, unless that address is the loopback one, and it replaces a
  ``--node-ip-address`` of ``127.0.0.1`` by the machine's address unless it runs in its
  single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the mode it uses on Windows and
  macOS): the head runs in that mode with ``--node-ip-address 127.0.0.1``, so every process of
  the cluster listens on 127.0.0.1 only;
* **a token.** Ray's token authentication (``RAY_AUTH_MODE=token``) with a random token made
  for the run, given to the head and the driver through the environment (never written to a file);
* **gone with the run.** The head runs in a session of its own under a guard process (this
  module's ``main``) that dies with the driver (:func:`.lifeline.exit_with_parent`): when the run
  ends, or its driver is killed by any signal, the guard ends every process of the session (the
  GCS, the raylet, the agents, the workers and actors) and removes the head's temporary folder.

A driver of a head on a loopback address (``--ray-address 127.0.0.1:PORT``, such as one started
with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address 127.0.0.1``) joins it
as a loopback node too (:func:`use_loopback`); otherwise Ray would look for the head at the
machine's address.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["LocalHead", "use_loopback", "is_loopback", "SINGLE_MACHINE_ENV", "main"]

#: Ray's single-machine mode: its node address is the loopback address (ray._private.ray_constants)
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``) names this machine's loopback interface."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host in _LOOPBACK or host.startswith("127.")


def use_loopback() -> None:
    """Make this process's Ray a loopback node (Ray's single-machine mode), before ``ray.init``."""
    os.environ[SINGLE_MACHINE_ENV] = "0"
    if "ray._private.ray_constants" in sys.modules:  # read when Ray is imported: set it on the module too
        sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalHead:
    """A loopback-only Ray head with a token, owned by this process (see the module docstring).

    Use :meth:`start`, then ``ray.init(address=head.address)`` in an environment updated with
    :attr:`driver_env` (:meth:`start` does it for this process); :meth:`stop` ends it.
    """

    def __init__(self, proc: subprocess.Popen[bytes], address: str, temp: str, env: dict[str, str]) -> None:
        self.proc, self.address, self.temp, self.driver_env = proc, address, temp, env
        self._saved = {k: os.environ.get(k) for k in env}

    @classmethod
    def start(cls, timeout: float = 180.0) -> LocalHead:
        port = _free_port()
        env = {SINGLE_MACHINE_ENV: "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
               "RAY_USAGE_STATS_ENABLED": "0"}
        temp = tempfile.mkdtemp(prefix="ray", dir="/tmp" if os.path.isdir("/tmp") else None)  # short socket paths
        head = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address",
                "127.0.0.1", "--port", str(port), "--include-dashboard", "false", "--disable-usage-stats",
                "--temp-dir", temp]
        log_path = os.path.join(temp, "head.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), temp, "--", *head],
                                    env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self = cls(proc, f"127.0.0.1:{port}", temp, env)
        deadline = time.monotonic() + timeout
        raylet = os.path.join(temp, "session_latest", "sockets", "raylet")
        while not (_listening(port) and os.path.exists(raylet)):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = ""
                with contextlib.suppress(OSError), open(log_path, "rb") as fh:
                    tail = fh.read()[-3000:].decode("utf-8", "replace")
                self.stop()
                raise RuntimeError(f"the local Ray head did not start ({'it exited' if proc.poll() is not None else 'timed out'}):"
                                   f"\n{tail}")
            time.sleep(0.2)
        os.environ.update(env)
        use_loopback()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """End the head's session (the guard does it) and restore this process's environment."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        shutil.rmtree(self.temp, ignore_errors=True)
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------- the guard (a process of its own)
def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


def _session_members() -> list[int]:
    """The live processes of this process's session, but this one (Linux: from /proc)."""
    me, sid = os.getpid(), os.getsid(0)
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            if os.getsid(pid) == sid and _state(pid) not in ("Z", "X"):
                out.append(pid)
        except OSError:
            continue
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _reap(grace: float = 5.0) -> None:
    """End every process of this session: SIGTERM, then SIGKILL after ``grace`` seconds."""
    if not os.path.isdir("/proc"):  # no process table to read: the process group (the workers have their own)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(grace)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return
    _signal_all(_session_members(), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _session_members() and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_all(_session_members(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    """``python -m apertus_plugins.data.offline.rayhead PARENT_PID TEMP_DIR -- RAY_START_COMMAND...``: run the
    head until the parent dies or this process is told to stop (SIGTERM, SIGINT), then end its session."""
    from .lifeline import exit_with_parent

    argv = sys.argv[1:] if argv is None else argv
    parent, temp, cmd = int(argv[0]), argv[1], argv[argv.index("--") + 1 :]
    # A flag, not a threading.Event: the signal handlers run in the main thread, and an Event.set() there can
    # land while that thread holds the Event's own lock inside Event.wait() (a deadlock: the head outlived
    # its driver). Setting a list item takes no lock, from a handler or the lifeline's thread alike.
    stop = [False]

    def request_stop(*_args: object) -> None:
        stop[0] = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, request_stop)
    exit_with_parent(parent, signal.SIGTERM, on_death=request_stop)
    child: Any = None
    if not stop[0]:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    while not stop[0] and child.poll() is None:
        time.sleep(0.2)
    _reap()
    if child is not None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            child.wait(timeout=5)
    shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
