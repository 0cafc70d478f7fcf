"""Fault points for tests and drills, and what a task records about the process that ran it.

``APERTUS_TOKENIZE_FAULT`` is a comma-separated list of points; when a point is reached the whole
run (the driver's process group, recorded in ``APERTUS_TOKENIZE_PGID``, which Ray workers get
too) is killed with SIGKILL, as an out-of-memory kill or a lost node would.

* ``plan-done:S``: right after planning shard S's summary is written;
* ``batch-mid:N``: inside batch N, after part of its shard data is on disk, before its commit;
* ``batch-done:N``: right after batch N's record is committed (between batches);
* ``merge-part:P``: right after part P's merged dataset and its record are written;
* ``merge-mid:K``: in the final merge (``single``), after K parts were appended to the first output;
* ``crash-item:FILE``: only the process decoding the media file FILE (its base name) is killed, each
  time, as a decoder crashing on that file would.

With ``--workers 0`` (everything in the driver's own process) the hook kills that process.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
from typing import Any

__all__ = ["FAULT_ENV", "PGID_ENV", "CRASHES", "fault_point", "crash_point", "faults_armed", "peak_rss_mb",
           "worker_info", "fsync"]

FAULT_ENV = "APERTUS_TOKENIZE_FAULT"
PGID_ENV = "APERTUS_TOKENIZE_PGID"

#: Times an item's worker process may die on it (in careful runs) before the item is skipped: once
#: may be a kill from outside, twice is the item.
CRASHES = 2


def _points() -> set[str]:
    spec = os.environ.get(FAULT_ENV)
    return {s.strip() for s in spec.split(",")} if spec else set()


def faults_armed() -> bool:
    """Whether any fault point is set (a step may then flush what it wrote before reaching one)."""
    return bool(os.environ.get(FAULT_ENV))


def crash_point(name: str) -> None:
    """``crash-item:FILE``: the process decoding the media file named FILE (its base name) dies by
    SIGKILL, as a crashing decoder would (this process only)."""
    if os.environ.get(FAULT_ENV) and f"crash-item:{os.path.basename(name.split(' (', 1)[0])}" in _points():
        os.kill(os.getpid(), signal.SIGKILL)


def fault_point(point: str, n: int) -> None:
    """Kill the run with SIGKILL if ``point:n`` is listed in ``$APERTUS_TOKENIZE_FAULT``."""
    if not os.environ.get(FAULT_ENV) or f"{point}:{n}" not in _points():
        return
    pgid = os.environ.get(PGID_ENV)
    if pgid:
        os.killpg(int(pgid), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def worker_info() -> dict[str, Any]:
    """The process a task ran in (its host, pid and peak memory), as its summary records it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "peak_rss_mb": peak_rss_mb()}


def fsync(path: str) -> None:
    """Flush a written file to disk (before it is renamed into place or uploaded)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
