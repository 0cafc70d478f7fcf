"""How many CPU threads one encode uses (the encoders on a CPU that other processes share).

Every torch operator on CPU is an OpenMP parallel region that ends in a barrier for all of its
threads. With as many threads as cores and another process keeping one core busy, one of the
encoder's threads is regularly descheduled and every barrier waits a scheduler slice for it: an
encode then runs 2-3x slower than with one thread fewer (``benchmarks/bench_encoders.py``, loaded
columns). An encode on CPU therefore sizes its thread pool to the cores that were free while the
previous encode ran:

- the CPU time spent by the whole machine (``/proc/stat``) minus this process's own, over the
  wall time of the previous encode, is the number of cores other processes kept busy;
- the next encode uses ``cores - busy elsewhere`` threads (rounded), at least 1 and at most the
  process's torch setting (``torch.get_num_threads()``, which the scope restores on exit).

``APERTUS_ENCODER_THREADS`` overrides the policy: an integer pins the count, ``auto`` (the default)
adapts, ``off`` leaves torch's setting alone. Encodes on a GPU are not affected. The choice never
changes a code: each operator computes the same values with any number of threads.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import torch

__all__ = ["ENV_VAR", "encode_threads", "planned_threads", "ThreadPolicyError"]

#: Environment variable: ``auto`` (default), ``off`` or a positive integer.
ENV_VAR = "APERTUS_ENCODER_THREADS"
_MIN_WALL_S = 0.05  # shorter calls are below /proc/stat's resolution (10 ms ticks): keep the last plan
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

_state_lock = threading.Lock()
_busy_elsewhere: float = 0.0  # cores other processes kept busy during the last measured encode


class ThreadPolicyError(ValueError):
    """An unusable ``APERTUS_ENCODER_THREADS`` value."""


def _policy() -> str | int:
    raw = os.environ.get(ENV_VAR, "auto").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw == "off":
        return "off"
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ThreadPolicyError(f"{ENV_VAR}={raw!r}: expected 'auto', 'off' or a positive number of threads")
    return n


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _machine_busy_s() -> float | None:
    """Seconds of CPU time the whole machine has spent busy (None where ``/proc/stat`` is unreadable)."""
    try:
        with open("/proc/stat", "rb") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu" or len(fields) < 8:
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK


def planned_threads(limit: int | None = None) -> int:
    """The thread count the next CPU encode will use under the current policy."""
    limit = limit or torch.get_num_threads()
    policy = _policy()
    if policy == "off":
        return limit
    if isinstance(policy, int):
        return policy
    with _state_lock:
        busy = _busy_elsewhere
    free = _cores() - busy
    return max(1, min(limit, int(free + 0.5)))


@contextlib.contextmanager
def encode_threads(device: torch.device | str) -> Iterator[int]:
    """Run one encode with :func:`planned_threads` torch threads on CPU; measure the load it met.

    Yields the thread count used (the unchanged torch setting on a GPU or with ``off``).
    """
    global _busy_elsewhere
    limit = torch.get_num_threads()
    if torch.device(device).type != "cpu" or _policy() == "off":
        yield limit
        return
    n = planned_threads(limit)
    busy0, cpu0, wall0 = _machine_busy_s(), time.process_time(), time.perf_counter()
    if n != limit:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        if n != limit:
            torch.set_num_threads(limit)
        wall = time.perf_counter() - wall0
        busy1 = _machine_busy_s()
        if busy0 is not None and busy1 is not None and wall >= _MIN_WALL_S:
            elsewhere = max(0.0, (busy1 - busy0) - (time.process_time() - cpu0)) / wall
            with _state_lock:
                _busy_elsewhere = elsewhere
