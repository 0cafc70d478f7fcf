"""The server launcher's error path and its HTTP helper (the success path runs in every server test)."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from apertus_plugins.serve import ServerError, VLLMServer, free_port, http_json


def test_a_server_that_cannot_start_is_an_error_with_its_log() -> None:
    # the core environment has no vLLM: the process exits at once and the error carries why
    server = VLLMServer("/nonexistent/model", python=sys.executable, startup_timeout=60)
    with pytest.raises(ServerError, match=r"(?s)exited with code \d+.*No module named 'vllm'") as info:
        server.start()
    assert "/nonexistent/model" in str(info.value)
    assert not server.alive()


def test_http_json_returns_status_and_body_for_success_and_client_errors() -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code = 400 if body.get("bad") else 200
            out = json.dumps({"echo": body}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    httpd = HTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        assert http_json(f"http://127.0.0.1:{port}/x", {"a": 1}) == (200, {"echo": {"a": 1}})
        assert http_json(f"http://127.0.0.1:{port}/x", {"bad": True}) == (400, {"echo": {"bad": True}})
    finally:
        httpd.shutdown()
