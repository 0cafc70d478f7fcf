"""A small client for an OpenAI-compatible server (vLLM) under test: chat requests and streams."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from ..serve import http_json
from .checkpoint_files import DoctorError

__all__ = ["ServeClient", "ServeError"]


class ServeError(RuntimeError):
    """A request the server answered with an error or not at all."""


class ServeClient:
    """Requests to ``url`` (``http://host:port`` or ``.../v1``) for the served model ``model``.

    Without ``model`` the first id of ``/v1/models`` is used. Construction fails with
    :class:`DoctorError` when the server cannot be reached.
    """

    def __init__(self, url: str, model: str | None = None, timeout: float = 300.0) -> None:
        base = url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        if not base.startswith(("http://", "https://")):
            raise DoctorError(f"--serve {url!r}: expected an http(s) URL such as http://127.0.0.1:8000")
        self.base = base
        self.timeout = timeout
        try:
            status, body = http_json(self.url("/v1/models"), timeout=min(timeout, 30.0))
        except (OSError, urllib.error.URLError) as exc:
            raise DoctorError(f"cannot reach the server at {url} ({exc})") from exc
        if status != 200 or not isinstance(body, dict) or not body.get("data"):
            raise DoctorError(f"{self.url('/v1/models')} answered {status}: {str(body)[:200]}")
        ids = [m.get("id") for m in body["data"]]
        if model is not None and model not in ids:
            raise DoctorError(f"the server at {url} serves {ids}, not {model!r}")
        self.model = model or ids[0]

    def url(self, path: str) -> str:
        return self.base + path

    def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """One greedy chat completion with the prompt's and the output's token ids; raises :class:`ServeError`."""
        payload = {"model": self.model, "messages": messages, "temperature": 0, "return_token_ids": True, **params}
        try:
            status, body = http_json(self.url("/v1/chat/completions"), payload, timeout=self.timeout)
        except (OSError, urllib.error.URLError) as exc:
            raise ServeError(f"no answer ({exc})") from exc
        if status != 200 or not isinstance(body, dict):
            raise ServeError(f"HTTP {status}: {_message(body)}")
        if not body.get("choices"):
            raise ServeError(f"no choices in the answer: {str(body)[:200]}")
        return body

    def stream(self, messages: list[dict[str, Any]], **params: Any) -> list[dict[str, Any]]:
        """A streamed chat completion: the decoded ``data:`` chunks, in order."""
        payload = {"model": self.model, "messages": messages, "temperature": 0, "stream": True, **params}
        req = urllib.request.Request(self.url("/v1/chat/completions"), data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        chunks = []
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                for raw in resp:
                    line = raw.decode("utf-8", errors="replace").strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
        except urllib.error.HTTPError as exc:
            raise ServeError(f"HTTP {exc.code}: {_message(exc.read().decode('utf-8', errors='replace'))}") from exc
        except (OSError, urllib.error.URLError, json.JSONDecodeError) as exc:
            raise ServeError(f"stream broken ({exc})") from exc
        return chunks


def _message(body: Any) -> str:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            return body[:200]
    if isinstance(body, Mapping):
        err = body.get("error", body)
        if isinstance(err, Mapping):
            return str(err.get("message", err))[:300]
        return str(err)[:300]
    return str(body)[:300]


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Content, reasoning and tool calls of a stream, joined as the whole answer would have them."""
    content, reasoning = "", ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(int(tc.get("index", 0)), {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                entry["name"] += fn.get("name") or ""
                entry["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"content": content, "reasoning": reasoning, "tool_calls": [calls[k] for k in sorted(calls)],
            "finish_reason": finish}
