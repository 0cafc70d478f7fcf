"""The one HTTP client of the package: requests and streams to an OpenAI-compatible server (vLLM).

Every part that talks to a served model goes through :class:`Client`: the doctor's serve checks,
the judges, the lmms-eval model, :class:`~apertus_plugins.testing.serve.VLLMServer`'s readiness probe, the
demo and the tests. It is built on ``httpx2`` (the maintained continuation of ``httpx``, which
``huggingface_hub`` and the ``openai`` SDK use), an optional dependency of the core (the ``http``
extra, also part of the ``vllm``, ``verl`` and ``eval`` extras)::

    from .client import Client

    with Client("http://127.0.0.1:8000/v1") as client:
        client.models()                                   # the served models (GET /v1/models)
        client.json("POST", "/chat/completions", {...})   # one answer, raises on HTTP errors
        for chunk in client.stream("/chat/completions", {...}):  # the decoded ``data:`` events
            ...

One retry policy (:class:`RetryPolicy`) for everything: a request is retried on connection
errors, timeouts and the statuses of :data:`RETRY_STATUSES` (429 and the gateway/overload 5xx),
with exponential backoff that honours a ``Retry-After`` header; any other status is the answer.
A stream is retried only before its first event, never in the middle (what was received would be
received twice). The API key is sent as ``Authorization: Bearer KEY`` on every request: the
``api_key`` argument, else ``$OPENAI_API_KEY`` when set (the variable the ``openai`` SDK and
lm-eval's ``local-chat-completions`` read).

Errors: :class:`Unreachable` (no connection or no answer after every attempt: the message names
the URL, the attempts and the last error) and :class:`ResponseError` (an answer that is not
a 2xx JSON body: the status and the server's error message). Both are :class:`ClientError`.
"""

from __future__ import annotations

import json as jsonlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NO_RETRY",
    "RETRY_STATUSES",
    "Client",
    "ClientError",
    "Reply",
    "ResponseError",
    "RetryPolicy",
    "Unreachable",
    "assemble",
    "error_message",
    "http_json",
    "require_httpx",
]

#: Statuses a request is retried on: the server asks to slow down or is (briefly) unavailable.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class ClientError(RuntimeError):
    """A request the server did not answer usefully."""


class Unreachable(ClientError, ConnectionError):
    """No connection, or no answer in time, after every attempt."""


class ResponseError(ClientError):
    """The server answered with an error status or with something that is not JSON."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def require_httpx() -> Any:
    """The ``httpx2`` module, or an ``ImportError`` that says how to install it."""
    try:
        import httpx2
    except ImportError as exc:
        raise ImportError("apertus_plugins.infra.client needs httpx2: pip install 'apertus-plugins[http]' "
                          "(or pip install httpx2)") from exc
    return httpx2


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a request is retried.

    Attributes:
        attempts: tries in all (1: no retry).
        backoff: seconds before the first retry; doubled for each further one.
        max_backoff: the longest wait between two tries (also caps ``Retry-After``).
        statuses: the HTTP statuses that are retried (connection errors and timeouts always are).
    """

    attempts: int = 4
    backoff: float = 0.5
    max_backoff: float = 8.0
    statuses: frozenset[int] = RETRY_STATUSES

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1, got {self.attempts}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("RetryPolicy backoff and max_backoff must not be negative")

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait after failed try number ``attempt`` (0-based)."""
        if retry_after:
            try:
                return min(max(float(retry_after), 0.0), self.max_backoff)
            except ValueError:
                pass
        return min(self.backoff * (2 ** attempt), self.max_backoff)


#: No retry: one try (the readiness probe of a starting server polls by itself).
NO_RETRY = RetryPolicy(attempts=1)


@dataclass(frozen=True)
class Reply:
    """One answer: the status and the body (decoded JSON, else the text)."""

    status: int
    body: Any

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def error_message(body: Any, limit: int = 300) -> str:
    """The server's error message in an answer body (OpenAI's ``{"error": {"message": ...}}`` and others)."""
    if isinstance(body, str):
        try:
            body = jsonlib.loads(body)
        except jsonlib.JSONDecodeError:
            return body[:limit]
    if isinstance(body, Mapping):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, Mapping):
            return str(err.get("message", err))[:limit]
        return str(err)[:limit]
    return str(body)[:limit]


def _decode(response: Any) -> Any:
    text = response.text
    try:
        return jsonlib.loads(text)
    except jsonlib.JSONDecodeError:
        return text


class Client:
    """Requests to one server, all with the same key, timeout and :class:`RetryPolicy`.

    Args:
        base_url: the API root (``http://host:port/v1``); request paths are appended to it. A
            full URL given as a path is used as it is.
        api_key: the bearer token; default ``$OPENAI_API_KEY`` when set, else none.
        timeout: seconds per try (connect and each read).
        retry: the retry policy (default :class:`RetryPolicy()`).
        headers: further headers of every request.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 60.0,
                 retry: RetryPolicy | None = None, headers: Mapping[str, str] | None = None) -> None:
        httpx = require_httpx()
        base = str(base_url).rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.base_url = base
        self.timeout = float(timeout)
        self.retry = retry or RetryPolicy()
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.api_key = key or None
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        if self.api_key:
            all_headers["Authorization"] = f"Bearer {self.api_key}"
        self._httpx = httpx
        self._client = httpx.Client(headers=all_headers, timeout=self.timeout, follow_redirects=True)

    # ------------------------------------------------------------------ plumbing
    def url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base_url + path

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unreachable(self, url: str, last: BaseException | None) -> Unreachable:
        tries = self.retry.attempts
        return Unreachable(f"no answer from {url} after {tries} attempt{'s' if tries != 1 else ''} "
                           f"(timeout {self.timeout:g} s each): {type(last).__name__}: {last}")

    # ------------------------------------------------------------------ requests
    def request(self, method: str, path: str, payload: Mapping[str, Any] | None = None,
                timeout: float | None = None) -> Reply:
        """One request under the retry policy; any answer (4xx and 5xx included) is returned.

        Raises:
            Unreachable: no answer after every attempt.
        """
        url = self.url(path)
        last: BaseException | None = None
        for attempt in range(self.retry.attempts):
            retry_after = None
            try:
                response = self._client.request(method, url, json=payload,
                                                timeout=timeout if timeout is not None else self.timeout)
            except self._httpx.TransportError as exc:  # connection refused or reset, timeouts
                last = exc
            else:
                reply = Reply(response.status_code, _decode(response))
                if reply.status not in self.retry.statuses or attempt + 1 == self.retry.attempts:
                    return reply
                last = ResponseError(f"HTTP {reply.status}: {error_message(reply.body)}", reply.status, reply.body)
                retry_after = response.headers.get("retry-after")
            if attempt + 1 < self.retry.attempts:
                time.sleep(self.retry.delay(attempt, retry_after))
        raise self._unreachable(url, last)

    def json(self, method: str, path: str, payload: Mapping[str, Any] | None = None,
             timeout: float | None = None) -> Any:
        """The decoded JSON of a 2xx answer.

        Raises:
            ResponseError: another status, or a body that is not JSON (the status and the message).
            Unreachable: no answer after every attempt.
        """
        reply = self.request(method, path, payload, timeout=timeout)
        if not reply.ok:
            raise ResponseError(f"{self.url(path)} answered HTTP {reply.status}: {error_message(reply.body)}",
                                reply.status, reply.body)
        if isinstance(reply.body, str):
            raise ResponseError(f"{self.url(path)} did not answer JSON: {reply.body[:200]!r}", reply.status,
                                reply.body)
        return reply.body

    def models(self) -> list[dict[str, Any]]:
        """``GET /models``: the served models (``id``, ``max_model_len``...)."""
        body = self.json("GET", "/models")
        data = body.get("data") if isinstance(body, Mapping) else None
        if not isinstance(data, list) or not data:
            raise ResponseError(f"{self.url('/models')} answered without a model list: {str(body)[:200]}", 200, body)
        return data

    def stream(self, path: str, payload: Mapping[str, Any], timeout: float | None = None) -> Iterator[Any]:
        """POST ``payload`` with ``"stream": true`` and yield each decoded ``data:`` event up to ``[DONE]``.

        Connection errors and retryable statuses are retried until the first event arrives; after
        it, a broken stream (an error, or an end without ``[DONE]``) raises :class:`Unreachable`
        (nothing is sent twice).

        Raises:
            ResponseError: an error status (the server's message), or an event that is not JSON.
            Unreachable: no answer after every attempt, or a stream broken midway.
        """
        url = self.url(path)
        body = {**payload, "stream": True}
        last: BaseException | None = None
        for attempt in range(self.retry.attempts):
            retry_after = None
            started = False
            try:
                with self._client.sse(url, method="POST", json=body,
                                      timeout=timeout if timeout is not None else self.timeout) as events:
                    response = events.response
                    if response.status_code >= 300:
                        response.read()
                        reply = Reply(response.status_code, _decode(response))
                        if reply.status not in self.retry.statuses or attempt + 1 == self.retry.attempts:
                            raise ResponseError(f"{url} answered HTTP {reply.status}: {error_message(reply.body)}",
                                                reply.status, reply.body)
                        last = ResponseError(f"HTTP {reply.status}: {error_message(reply.body)}", reply.status,
                                             reply.body)
                        retry_after = response.headers.get("retry-after")
                    else:
                        for event in events:
                            if event.data.strip() == "[DONE]":
                                return
                            if not event.data:
                                continue
                            try:
                                chunk = jsonlib.loads(event.data)
                            except jsonlib.JSONDecodeError as exc:
                                raise ResponseError(f"{url}: a stream event that is not JSON: {event.data[:200]!r}",
                                                    response.status_code, event.data) from exc
                            started = True
                            yield chunk
                        # an OpenAI stream ends with [DONE]: without it the answer was cut short
                        raise Unreachable(f"the stream from {url} broke after it began: it ended without [DONE]")
            except self._httpx.TransportError as exc:
                if started:
                    raise Unreachable(f"the stream from {url} broke after it began: {type(exc).__name__}: {exc}") \
                        from exc
                last = exc
            if attempt + 1 < self.retry.attempts:
                time.sleep(self.retry.delay(attempt, retry_after))
        raise self._unreachable(url, last)


def http_json(url: str, payload: Mapping[str, Any] | None = None, timeout: float = 60.0,
              headers: Mapping[str, str] | None = None, api_key: str | None = None,
              retry: RetryPolicy | None = None) -> tuple[int, Any]:
    """One GET (no payload) or POST of JSON to a full URL: ``(status, decoded JSON or text)``.

    4xx and 5xx answers are returned as they are (after the retry policy); a server that does not
    answer raises :class:`Unreachable`. For tests and scripts; parts of the package hold a :class:`Client`.
    """
    with Client(url, api_key=api_key, timeout=timeout, retry=retry, headers=headers) as client:
        reply = client.request("GET" if payload is None else "POST", url, payload)
    return reply.status, reply.body


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Content, reasoning and tool calls of a streamed chat completion, joined as the whole answer has them."""
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
