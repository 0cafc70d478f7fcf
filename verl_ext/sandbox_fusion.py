"""The code reward's remote backend: verl's own SandboxFusion client, where the user configures a server.

verl's convention for code execution is a SandboxFusion server (``reward.sandbox_fusion.url``, its
``max_concurrent`` and ``memory_limit_mb``). :class:`SandboxFusionRunner` is a
:class:`~apertus_plugins.posttrain.sandbox.CodeRunner` that sends each run through verl's client
(``verl.utils.reward_score.sandbox_fusion.utils.call_sandbox_api``: one ``run_code`` request, its retries
on gateway timeouts) and maps the answer onto the sandbox statuses, so the ``code`` reward judges the same
test cases with the same comparison whichever backend runs the program. The ``apertus`` reward manager
picks it when ``reward.sandbox_fusion.url`` is set (:mod:`verl_ext.rewards`).
"""

from __future__ import annotations

import threading
import time

from apertus_plugins.posttrain.sandbox import CodeRunner, Execution, Limits, SandboxUnavailable

__all__ = ["SandboxFusionRunner", "sandbox_fusion_runner"]

_RUNNERS: dict[tuple, SandboxFusionRunner] = {}
_LOCK = threading.Lock()


class SandboxFusionRunner(CodeRunner):
    """Runs programs on a SandboxFusion server through verl's client.

    Args:
        url: the server's ``run_code`` endpoint, e.g. ``http://sandbox:8080/run_code`` (verl's
            ``reward.sandbox_fusion.url``).
        max_concurrent: requests at once from this process (verl's ``reward.sandbox_fusion.max_concurrent``).
        memory_limit_mb: the server's memory limit per run (verl's ``reward.sandbox_fusion.memory_limit_mb``).
        limits: default :class:`Limits` (time and output size; the memory limit is ``memory_limit_mb``).
        language: SandboxFusion's language name of the programs.
    """

    name = "sandbox_fusion"

    def __init__(self, url: str, max_concurrent: int = 64, memory_limit_mb: int = 1024, limits: Limits | None = None,
                 language: str = "python") -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"SandboxFusion url must be an http(s) URL of its run_code endpoint, got {url!r}")
        self.url = url
        self.max_concurrent = int(max_concurrent)
        if self.max_concurrent < 1:
            raise ValueError(f"SandboxFusion max_concurrent must be >= 1, got {max_concurrent}")
        self.limits = (limits or Limits()).tightened(memory_mb=int(memory_limit_mb))
        self.language = language
        self._slots = threading.BoundedSemaphore(self.max_concurrent)
        self._checked = False

    def check(self) -> None:
        if self._checked:
            return
        out = self._run("print(sum(range(10)))", "", self.limits)
        if out.status != "ok" or out.stdout.strip() != "45":
            raise SandboxUnavailable(f"the SandboxFusion server at {self.url} cannot run a probe program "
                                     f"({out.status}): {(out.detail or out.stderr)[-500:]}")
        self._checked = True

    def run(self, program: str, stdin: str = "", limits: Limits | None = None) -> Execution:
        self.check()
        return self._run(program, stdin, limits or self.limits)

    def _run(self, program: str, stdin: str, limits: Limits) -> Execution:
        from verl.utils.reward_score.sandbox_fusion.utils import call_sandbox_api

        t0 = time.monotonic()
        with self._slots:
            response, error = call_sandbox_api(sandbox_fusion_url=self.url, code=program, stdin=stdin,
                                               compile_timeout=limits.time_s, run_timeout=limits.time_s,
                                               memory_limit_mb=limits.memory_mb, language=self.language)
        seconds = time.monotonic() - t0
        if error or not isinstance(response, dict):
            return Execution("sandbox_error", seconds=seconds, detail=f"SandboxFusion at {self.url}: {error}")
        run = response.get("run_result") or {}
        stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        code = run.get("return_code")
        ran = float(run.get("execution_time") or seconds)
        if len(stdout.encode()) + len(stderr.encode()) > limits.output_bytes:
            return Execution("output_limit", stdout[:limits.output_bytes], stderr[:limits.output_bytes],
                             code, seconds=ran, detail=f"wrote more than {limits.output_bytes} bytes")
        api = response.get("status")
        if api == "Success" and run.get("status") == "Finished" and code == 0:
            return Execution("ok", stdout, stderr, 0, seconds=ran)
        if api == "SandboxError" or not run:
            return Execution("sandbox_error", stdout, stderr, code, seconds=ran,
                             detail=f"SandboxFusion status {api}: {response.get('message', '')}"[:500])
        if run.get("status") == "TimeLimitExceeded":
            return Execution("timeout", stdout, stderr, code, seconds=ran, detail=f"time limit {limits.time_s:g} s")
        if "MemoryError" in stderr[-2000:]:
            return Execution("memory_limit", stdout, stderr, code, seconds=ran,
                             detail=f"memory limit {limits.memory_mb} MiB")
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        return Execution("runtime_error", stdout, stderr, code, seconds=ran,
                         detail=f"{run.get('status')} (exit {code}): {tail[-300:]}")


def sandbox_fusion_runner(url: str, max_concurrent: int = 64, memory_limit_mb: int = 1024,
                          limits: dict | None = None) -> SandboxFusionRunner:
    """The process's runner for one server and settings (its concurrency bound is shared by every caller)."""
    lim = Limits.from_options(limits)
    key = (url, int(max_concurrent), int(memory_limit_mb), lim)
    with _LOCK:
        if key not in _RUNNERS:
            _RUNNERS[key] = SandboxFusionRunner(url, int(max_concurrent), int(memory_limit_mb), lim)
        return _RUNNERS[key]
