"""The guard of a run's own Ray head (``python -m apertus_plugins.data.offline.rayhead``), without Ray: it runs
a command in a session of its own and ends that session, and removes the head's folder, when its parent dies
or when it is told to stop.

The guard used to stop on a ``threading.Event`` set from its signal handler, which could deadlock when the
signal arrived while its main thread held the Event's lock inside ``Event.wait`` (a CI run saw the head of a
killed driver outlive it). Each case here runs several times, the signal sent at different moments.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUARD = [sys.executable, "-m", "apertus_plugins.data.offline.rayhead"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _session(sid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid and _alive(int(name)):
                    out.append(int(name))
            except OSError:
                continue
    return out


def _wait_gone(sid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while _session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _session(sid)


def _wait_for_command(guard: int) -> None:
    """Until the guard (the leader of its own session) has started its command in that session."""
    deadline = time.monotonic() + 60
    while not [p for p in _session(guard) if p != guard]:
        assert time.monotonic() < deadline, "the guard never started its command"
        time.sleep(0.05)


@pytest.mark.parametrize("delay", [0.0, 0.13, 0.26, 0.39, 0.52, 0.71])
def test_a_stop_signal_ends_the_command_and_the_guard_and_removes_the_folder(tmp_path: Path, delay: float) -> None:
    temp = tmp_path / "head"
    temp.mkdir()
    guard = subprocess.Popen([*GUARD, str(os.getpid()), str(temp), "--", *SLEEPER], env=_env(),
                             start_new_session=True)
    try:
        _wait_for_command(guard.pid)
        time.sleep(delay)  # the signal lands somewhere in the guard's polling loop
        guard.send_signal(signal.SIGTERM)
        assert guard.wait(timeout=30) == 0
        assert not _wait_gone(guard.pid, 10), "the guard's command outlived it"
        assert not temp.exists()
    finally:
        for pid in _session(guard.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("attempt", range(3))
def test_the_guard_ends_its_session_when_its_parent_is_killed(tmp_path: Path, attempt: int) -> None:
    temp = tmp_path / "head"
    temp.mkdir()
    parent_code = ("import os, subprocess, sys, time\n"
                   f"g = subprocess.Popen({GUARD!r} + [str(os.getpid()), {str(temp)!r}, '--'] + {SLEEPER!r},"
                   " start_new_session=True)\n"
                   "print(g.pid, flush=True)\n"
                   "time.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=_env(), stdout=subprocess.PIPE, text=True)
    guard = int(parent.stdout.readline())
    try:
        _wait_for_command(guard)
        time.sleep(0.2 * attempt)
        parent.kill()  # the driver alone, by a signal nothing can catch
        parent.wait(timeout=30)
        assert not _wait_gone(guard, 30), "the guard or its command outlived the killed parent"
        assert not temp.exists()
    finally:
        for pid in _session(guard):
            os.kill(pid, signal.SIGKILL)
