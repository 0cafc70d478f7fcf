"""The served model under test, through the package's one HTTP client (:mod:`apertus_plugins.infra.client`).

:class:`ServeClient` adds the doctor's request defaults (greedy, the prompt's token ids) to a
:class:`~apertus_plugins.infra.client.Client` and reports failures as :class:`ServeError`, which a
check turns into its ``FAIL`` line.
"""

from __future__ import annotations

from typing import Any

from apertus_plugins.infra.client import Client, ClientError, Unreachable, assemble

from .checkpoint_files import DoctorError

__all__ = ["ServeClient", "ServeError", "assemble"]


class ServeError(RuntimeError):
    """A request the server answered with an error or not at all."""


class ServeClient:
    """Requests to ``url`` (``http://host:port`` or ``.../v1``) for the served model ``model``.

    Without ``model`` the first id of ``/v1/models`` is used. Construction fails with
    :class:`DoctorError` when the server cannot be reached. ``api_key``: see :class:`Client`.
    """

    def __init__(self, url: str, model: str | None = None, timeout: float = 300.0, api_key: str | None = None) -> None:
        base = url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        if not base.startswith(("http://", "https://")):
            raise DoctorError(f"--serve {url!r}: expected an http(s) URL such as http://127.0.0.1:8000")
        self.base = base
        self.timeout = timeout
        self.client = Client(base + "/v1", api_key=api_key, timeout=timeout)
        try:
            served = self.client.models()
        except Unreachable as exc:
            raise DoctorError(f"cannot reach the server at {url} ({exc})") from exc
        except ClientError as exc:
            raise DoctorError(f"the server at {url} cannot be used: {exc}") from exc
        ids = [m.get("id") for m in served]
        if model is not None and model not in ids:
            raise DoctorError(f"the server at {url} serves {ids}, not {model!r}")
        self.model = model or ids[0]

    def url(self, path: str) -> str:
        return self.base + path

    def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """One greedy chat completion with the prompt's and the output's token ids; raises :class:`ServeError`."""
        payload = {"model": self.model, "messages": messages, "temperature": 0, "return_token_ids": True, **params}
        try:
            body = self.client.json("POST", "/chat/completions", payload)
        except ClientError as exc:
            raise ServeError(str(exc)) from exc
        if not isinstance(body, dict) or not body.get("choices"):
            raise ServeError(f"no choices in the answer: {str(body)[:200]}")
        return body

    def stream(self, messages: list[dict[str, Any]], **params: Any) -> list[dict[str, Any]]:
        """A streamed chat completion: the decoded ``data:`` chunks, in order."""
        payload = {"model": self.model, "messages": messages, "temperature": 0, **params}
        try:
            return list(self.client.stream("/chat/completions", payload))
        except ClientError as exc:
            raise ServeError(str(exc)) from exc
