"""Run the suites' nox sessions side by side (``python3 tools/dev.py test``, ``--jobs N``).

A suite keeps about 2 cores busy on its own (its servers, Ray workers and torch threads), but not all the
time: imports, servers and Ray clusters starting, waits between a trainer's steps leave gaps another
suite fills. On the project's 2-core, 24 GiB machine every suite ran in 36.5 minutes two at a time
against 40.2 one after the other (each suite about 1.9 times slower than alone). So the suites run one per 2
cores, at least 2 (:func:`default_jobs`). A suite starts when a job is free and the suites already running
leave room in memory for it:

* **the order**: the longest suites first (:data:`LONGEST_FIRST`), so that the short ones fill in beside
  them and the run ends with short suites, not with one long one alone;
* **memory**: each suite's peak (the memory of its whole process tree, measured on this
  project's 2-core runs, :data:`PEAK_GIB`) is held against a budget of 3/4 of the machine's memory:
  the suites that serve a model (vLLM servers, verl's Ray cluster with a colocated vLLM) do not meet
  where two of them would not fit.

Each suite's output goes to ``<reports>/<suite>.log``; a line says when a suite starts and ends, and
the end of a failed suite's log is printed. The peak memory each suite reached is measured again (its
process tree's proportional set size, sampled every 15 seconds) and printed in the summary.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LONGEST_FIRST", "PEAK_GIB", "Finished", "default_jobs", "run_parallel", "start_order", "tree_memory"]

#: The suites, the longest first (minutes of pytest on the shared 2-core machine, one at a time:
#: verl-train 11.5, vllm 8.4, megatron-train 5.8, megatron 5.1, eval 3.0, verl 2.1, reference 2.0,
#: core 1.2, megatron-bridge 0.4, docs 0.1).
LONGEST_FIRST = ("verl-train", "vllm", "megatron-train", "megatron", "eval", "verl", "reference", "core",
                 "megatron-bridge", "docs")

#: The peak memory (GiB, proportional set size) of each suite's process tree, measured in this project's runs and
#: rounded up; a suite not named here counts as :data:`DEFAULT_PEAK_GIB`.
PEAK_GIB: dict[str, float] = {
    "verl-train": 12.0, "vllm": 10.5, "eval": 5.5, "megatron-train": 4.0, "megatron": 2.5, "reference": 2.5,
    "verl": 4.5, "core": 1.0, "megatron-bridge": 2.5, "docs": 0.5,
}
DEFAULT_PEAK_GIB = 4.0
#: The share of the machine's memory the suites running together may plan to use.
MEMORY_SHARE = 0.75


def memory_gib() -> float:
    """The machine's memory (``MemTotal`` of ``/proc/meminfo``), 16 GiB where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 16.0


def default_jobs() -> int:
    """How many suites run at once when ``--jobs`` is not given: ``$APERTUS_TEST_JOBS``, else one per 2
    cores but at least 2 (a suite keeps about 2 cores busy on its own, yet leaves gaps another fills: on
    a 2-core machine two at once ran every suite in 36.5 minutes, one after the other in 40.2), at most 4;
    1 on a single core or below 16 GiB."""
    env = os.environ.get("APERTUS_TEST_JOBS")
    if env:
        try:
            jobs = int(env)
        except ValueError:
            raise SystemExit(f"APERTUS_TEST_JOBS={env!r}: expected a whole number of suites to run at once") from None
        if jobs < 1:
            raise SystemExit(f"APERTUS_TEST_JOBS={env!r}: at least 1 suite runs at a time")
        return jobs
    cores = os.cpu_count() or 1
    if cores < 2 or memory_gib() < 16:
        return 1
    return min(4, max(2, cores // 2))


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: the fields after its last ")"
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _pss(pid: int, page: int) -> int:
    """A process's proportional set size (its resident memory, pages shared with others divided among
    them: the libraries every worker of a Ray cluster or a vLLM server maps would otherwise count once
    per process), from ``smaps_rollup``; its resident size where that cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
    except (OSError, IndexError, ValueError):
        return 0


def tree_memory(pid: int, kids: dict[int, list[int]] | None = None) -> int:
    """The memory (bytes, proportional set size) of ``pid`` and every process below it; 0 where ``/proc``
    cannot be read."""
    kids = _children() if kids is None else kids
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _pss(p, page)
        todo.extend(kids.get(p, ()))
    return total


@dataclass
class Finished:
    """A suite that ran: its exit status, its wall time (its environment's build included) and its peak memory."""

    suite: str
    returncode: int
    seconds: float
    peak_bytes: int
    log: Path


@dataclass
class _Running:
    suite: str
    proc: subprocess.Popen[bytes]
    started: float
    log: Path
    peak: int = 0
    out: object = field(default=None, repr=False)
    #: when its memory is read next: at the first poll after it starts (a suite of a few seconds gets a peak
    #: too), then every ``sample`` seconds
    sample_at: float = 0.0


def start_order(suites: Sequence[str]) -> list[str]:
    """The order in which :func:`run_parallel` starts ``suites`` (the longest first; memory may hold one back)."""
    rank = {s: i for i, s in enumerate(LONGEST_FIRST)}
    return sorted(suites, key=lambda s: rank.get(s, len(rank)))


def run_parallel(suites: Sequence[str], command: Callable[[str], list[str]], *, jobs: int, logs: Path,
                 env: dict[str, str], cwd: Path, say: Callable[[str], None],
                 budget_gib: float | None = None, poll: float = 2.0, sample: float = 15.0) -> list[Finished]:
    """Run ``command(suite)`` for every suite, at most ``jobs`` at once within the memory budget, each
    in its own process group with its output in ``logs/<suite>.log``; return them in the order they ended.

    A suite whose planned peak alone is over the budget still runs, alone. Ended suites are seen every
    ``poll`` seconds; a suite's memory is read at the first poll after it starts, then every ``sample``
    seconds (reading the proportional set size walks every mapping of every process: 0.3 s of CPU for two
    suites' trees, which every 2 s took 15% of a core from the suites).
    """
    budget = MEMORY_SHARE * memory_gib() if budget_gib is None else budget_gib
    waiting = start_order(suites)
    running: list[_Running] = []
    done: list[Finished] = []
    logs.mkdir(parents=True, exist_ok=True)
    try:
        while waiting or running:
            planned = sum(PEAK_GIB.get(r.suite, DEFAULT_PEAK_GIB) for r in running)
            for suite in list(waiting):
                if len(running) >= jobs:
                    break
                need = PEAK_GIB.get(suite, DEFAULT_PEAK_GIB)
                if running and planned + need > budget:
                    continue
                log = logs / f"{suite}.log"
                out = open(log, "wb")  # noqa: SIM115 - closed when the suite ends
                proc = subprocess.Popen(command(suite), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                running.append(_Running(suite, proc, time.monotonic(), log, out=out))
                waiting.remove(suite)
                planned += need
                beside = ", ".join(r.suite for r in running if r.suite != suite)
                say(f"{suite}: started" + (f" beside {beside}" if beside else "") + f" (output: {log})")
            time.sleep(poll)
            now = time.monotonic()
            due = [r for r in running if now >= r.sample_at]
            if due:
                kids = _children()
                for r in due:
                    r.peak = max(r.peak, tree_memory(r.proc.pid, kids))
                    r.sample_at = now + sample
            for r in list(running):
                if r.proc.poll() is None:
                    continue
                r.out.close()  # type: ignore[attr-defined]
                running.remove(r)
                secs = time.monotonic() - r.started
                done.append(Finished(r.suite, r.proc.returncode, secs, r.peak, r.log))
                state = "ok" if r.proc.returncode == 0 else f"FAILED (exit {r.proc.returncode})"
                say(f"{r.suite}: {state} in {secs / 60:.1f} min, peak memory {r.peak / 2**30:.1f} GiB")
    finally:
        for r in running:  # interrupted: end the suites still running, their whole process groups
            try:
                os.killpg(r.proc.pid, 15)
            except ProcessLookupError:
                pass
    return done


def tail(path: Path, lines: int = 120) -> str:
    """The last ``lines`` lines of a log."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])
