"""Helper processes that end when the process that started them dies, whatever killed it.

A run's local worker processes and the guard of its local Ray head (:mod:`.rayhead`) call
:func:`exit_with_parent` first thing. Two mechanisms, so one failing never leaves an orphan:

* Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the kernel sends the signal the
  moment the parent exits, including by SIGKILL;
* a watch thread that checks every ``interval`` seconds whether the parent is still the process's
  parent (a dead parent's children are handed to init or a subreaper), for systems without prctl.

A helper started by a parent that died before the call exits at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["exit_with_parent", "parent_death_signal"]

_PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kill_self(sig: int) -> None:
    os.kill(os.getpid(), sig)


def exit_with_parent(parent: int, sig: int = signal.SIGKILL, *, prctl: bool = True, interval: float | None = 1.0,
                     on_death: Callable[[], None] | None = None) -> None:
    """End this process when ``parent`` (its parent's pid) dies.

    ``sig`` is what the parent-death signal and the watch thread send to this process (SIGKILL:
    nothing runs after; SIGTERM: a handler may clean up). ``on_death`` replaces the watch thread's
    signal (it runs in the thread). ``prctl=False`` or ``interval=None`` turn one mechanism off
    (the tests check each alone).
    """
    if prctl:
        parent_death_signal(sig)
    if os.getppid() != parent:  # died before the signal was armed
        (on_death or (lambda: _kill_self(sig)))()
        return
    if interval is None:
        return

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                (on_death or (lambda: _kill_self(sig)))()
                return

    threading.Thread(target=watch, name="apertus-lifeline", daemon=True).start()
