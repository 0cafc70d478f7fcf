"""Run the checks that apply to the given inputs and collect a :class:`~.report.Report`."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from . import (  # noqa: F401 - each module registers its checks
    checks_checksums,
    checks_compare,
    checks_config,
    checks_layout,
    checks_serve,
    checks_template,
    checks_tokenizer,
)
from .checkpoint_files import CheckpointFiles, DoctorError
from .checks_checksums import load_checksum_manifest
from .registry import CHECKS, GROUPS, Check, Context
from .report import FAIL, Report, Result
from .serve_client import ServeClient, ServeError

__all__ = ["run_doctor", "select_checks", "load_probe_prompts"]


def select_checks(only: Iterable[str] | None = None, compare: bool = False, serve: bool = False,
                  checksums: bool = False) -> list[Check]:
    """The checks of one run, in run order: every offline group, ``checksums``, ``compare`` and ``serve`` when given.

    ``only`` keeps the named groups or check ids (``"tokenizer"``, ``"config.rope"``); an unknown
    name raises :class:`DoctorError`.
    """
    wanted = None
    if only is not None:
        wanted = {w.strip() for w in only if w and w.strip()}
        known = set(GROUPS) | {c.id for c in CHECKS}
        unknown = sorted(wanted - known)
        if unknown:
            raise DoctorError(f"unknown check or group {', '.join(unknown)}; groups are {', '.join(GROUPS)}, "
                              f"checks {', '.join(c.id for c in CHECKS)}")
    out = []
    for group in GROUPS:
        if (group == "compare" and not compare) or (group == "serve" and not serve) or (
                group == "checksums" and not checksums):
            continue
        for c in CHECKS:
            if c.group == group and (wanted is None or c.id in wanted or c.group in wanted):
                out.append(c)
    return out


def load_probe_prompts(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Degeneration probe prompts from a JSON list or JSON lines: ``{"prompt": ...}`` or ``{"messages": [...]}``,
    optionally with ``"request"`` (extra request fields)."""
    p = Path(path)
    if not p.is_file():
        raise DoctorError(f"{p}: no such probe prompt file")
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise DoctorError(f"{p}: neither a JSON list nor JSON lines ({exc})") from exc
    if not isinstance(data, list) or not data or not all(isinstance(d, dict) for d in data):
        raise DoctorError(f"{p}: expected a non-empty list of objects with 'prompt' or 'messages'")
    for k, item in enumerate(data):
        if not isinstance(item.get("prompt"), str) and not isinstance(item.get("messages"), list):
            raise DoctorError(f"{p}: item {k} has neither 'prompt' (text) nor 'messages' (a list)")
    return data


def run_doctor(checkpoint: str | os.PathLike[str], *, serve: str | None = None, model: str | None = None,
               compare: str | os.PathLike[str] | None = None, datasets: Sequence[str | os.PathLike[str]] = (),
               only: Iterable[str] | None = None, probe_prompts: Sequence[dict[str, Any]] | None = None,
               probe_tokens: int = 256, timeout: float = 300.0, progress: Any = None,
               api_key: str | None = None, checksums: str | os.PathLike[str] | None = None) -> Report:
    """Run the doctor on ``checkpoint`` and return the report.

    Args:
        checkpoint: the checkpoint directory (a tokenizer directory alone runs the tokenizer and
            template groups; the config checks then fail for want of ``config.json``).
        serve: the URL of a server of this checkpoint (``http://host:port``); adds the ``serve`` checks.
        model: the served model name (default: the server's first).
        compare: another checkpoint (another stage); adds the ``compare`` checks.
        datasets: manifests or indexed dataset prefixes whose image layout ``layout.image`` checks.
        only: groups or check ids to run.
        probe_prompts: the degeneration probe's prompts (default :data:`checks_serve.DEFAULT_PROBES`).
        probe_tokens: the probe's ``max_tokens``.
        timeout: seconds per server request.
        progress: called with each :class:`Result` as it is ready.
        api_key: the server's API key (default ``$OPENAI_API_KEY``; see :mod:`apertus_plugins.infra.client`).
        checksums: a checksum manifest in the tokenizer repository's format (``validation/Apertus_1p5.md5``,
            ``md5sum``'s lines); adds the ``checksums`` check of the files it names.

    Raises:
        DoctorError: a checkpoint that is not a directory, an unreachable server, an unknown check.
    """
    checks = select_checks(only, compare=compare is not None, serve=serve is not None,
                           checksums=checksums is not None)
    manifest = load_checksum_manifest(checksums) if checksums is not None else None
    ckpt = CheckpointFiles(checkpoint)
    other = CheckpointFiles(compare) if compare is not None else None
    if probe_tokens <= 0:
        raise DoctorError(f"probe_tokens must be positive, got {probe_tokens}")
    server = ServeClient(serve, model=model, timeout=timeout, api_key=api_key) if serve is not None else None
    ctx = Context(ckpt, other=other, server=server, datasets=list(datasets), probe_prompts=probe_prompts,
                  probe_tokens=probe_tokens, checksums=manifest,
                  checksums_name=Path(checksums).name if checksums is not None else "")
    results = []
    for c in checks:
        t0 = time.perf_counter()
        try:
            out = c.func(ctx)
            status, evidence = out[0], out[1]
            details = out[2] if len(out) > 2 else {}
        except Exception as exc:  # a check that cannot run fails, naming why
            message = str(exc) if isinstance(exc, (DoctorError, ServeError)) else f"{type(exc).__name__}: {exc}"
            status, evidence, details = FAIL, message.replace("\n", " "), {}
        result = Result(c.id, c.group, c.title, status, evidence, details, round(time.perf_counter() - t0, 3))
        results.append(result)
        if progress is not None:
            progress(result)
    try:
        layout = ctx.layout_name
    except Exception:
        layout = ""
    return Report(str(ckpt.path), results, compare=str(other.path) if other else None,
                  serve=server.base if server else None, datasets=[str(d) for d in datasets], layout=layout)
