"""What every sandbox backend implements: run one program on one input, under limits, and say what happened.

A backend (:class:`CodeRunner`) runs a Python program with a given standard input and returns an
:class:`Execution`: how it ended (:data:`STATUSES`), its exit code or signal, and its output, cut at
``limits.output_bytes``. Judging (test cases, output comparison, verdicts) is backend-free and lives in
:mod:`.judge`; the local backend is :class:`~.bubblewrap.BubblewrapSandbox`, the remote one verl's
SandboxFusion client (:mod:`verl_ext.sandbox_fusion`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = ["STATUSES", "CodeRunner", "Execution", "Limits", "SandboxUnavailable"]

#: How a run ends. ``ok``: exit status 0; ``runtime_error``: another exit status or a signal;
#: ``timeout``: wall-clock or CPU limit; ``memory_limit``: the address-space limit (MemoryError or a
#: failed allocation); ``output_limit``: more than ``output_bytes`` of stdout + stderr; ``file_limit``:
#: a file larger than ``file_bytes`` (SIGXFSZ) or a full scratch directory; ``sandbox_error``: the
#: sandbox itself could not run the program (not the program's fault).
STATUSES = ("ok", "runtime_error", "timeout", "memory_limit", "output_limit", "file_limit", "sandbox_error")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run anything on this machine (missing tool, no user namespaces, no interpreter)."""


@dataclass(frozen=True)
class Limits:
    """Limits of one run of one program.

    Args:
        time_s: wall-clock seconds; the CPU-time limit is the same number of seconds (rounded up).
        memory_mb: address space of each process (``RLIMIT_AS``), MiB.
        processes: processes and threads the program may have at once, itself included (``RLIMIT_NPROC``,
            counted inside the sandbox's own user namespace).
        output_bytes: stdout + stderr kept; a program writing more is stopped (``output_limit``).
        file_bytes: the largest file a process may write (``RLIMIT_FSIZE``).
        scratch_mb: size of the writable scratch directory (a tmpfs), MiB.
        open_files: file descriptors per process (``RLIMIT_NOFILE``).
    """

    time_s: float = 5.0
    memory_mb: int = 1024
    processes: int = 16
    output_bytes: int = 8 << 20
    file_bytes: int = 16 << 20
    scratch_mb: int = 64
    open_files: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"sandbox limit {f.name} must be a positive number, got {value!r}")
        if self.processes < 2:
            raise ValueError("sandbox limit processes must be at least 2 (the sandbox's init and the program)")

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> Limits:
        """Limits from a mapping (a config section); unknown keys are an error naming them."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown sandbox limits {unknown}; known: {sorted(known)}")
        return cls(**options)

    def tightened(self, time_s: float | None = None, memory_mb: int | None = None) -> Limits:
        """These limits with a problem's own time or memory limit, where it gives one."""
        changes: dict[str, Any] = {}
        if time_s is not None:
            changes["time_s"] = float(time_s)
        if memory_mb is not None:
            changes["memory_mb"] = int(memory_mb)
        return replace(self, **changes) if changes else self


@dataclass(frozen=True)
class Execution:
    """How one run ended (see :data:`STATUSES`), with its output (decoded as UTF-8, errors replaced)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    seconds: float = 0.0
    detail: str = ""
    #: backend facts about the run (the local sandbox: ``pid_namespace``, the inode of its PID namespace)
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown execution status {self.status!r}; statuses: {STATUSES}")


class CodeRunner(ABC):
    """A sandbox backend: runs one Python program on one standard input under :class:`Limits`.

    ``check`` fails early (:class:`SandboxUnavailable`, naming the cause) when nothing can run;
    ``max_concurrent`` is how many runs the backend allows at once in this process (callers may
    submit more from many threads: the backend makes the extra ones wait).
    """

    name: str = "runner"
    max_concurrent: int = 1

    @abstractmethod
    def run(self, program: str, stdin: str = "", limits: Limits | None = None) -> Execution:
        """Run ``program`` (Python source) with ``stdin``; never raises for what the program does."""

    def check(self) -> None:
        """Raise :class:`SandboxUnavailable` when this backend cannot run programs here."""
        return None
