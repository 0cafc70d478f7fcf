"""The server launcher's error path, and the package's HTTP client against a real server on loopback.

The server is the standard library's ``http.server`` in a thread: it fails the first N requests
of a path as told (a status, a dropped connection, a ``Retry-After``), answers JSON, streams
server-sent events (optionally breaking the stream midway) and records what it received, so the
retry policy, the API key and streaming are checked over real sockets.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from apertus_plugins.infra.client import (
    RETRY_STATUSES,
    Client,
    ResponseError,
    RetryPolicy,
    Unreachable,
    assemble,
    http_json,
)
from apertus_plugins.testing.serve import CPU_ARGS, ONE_PROCESS_ARGS, ServerError, VLLMServer, free_port

FAST = RetryPolicy(attempts=3, backoff=0.01, max_backoff=0.05)


def test_a_server_that_cannot_start_is_an_error_with_its_log() -> None:
    # the core environment has no vLLM: the process exits at once and the error carries why
    server = VLLMServer("/nonexistent/model", python=sys.executable, startup_timeout=60)
    with pytest.raises(ServerError, match=r"(?s)exited with code \d+.*No module named 'vllm'") as info:
        server.start()
    assert "/nonexistent/model" in str(info.value)
    assert not server.alive()


FAKE_SERVER = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
time.sleep(float(args[args.index("--delay") + 1]))  # a start that takes a while


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        out = json.dumps({"data": [{"id": "fake"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _fake_vllm(root: Path, api_server: str) -> None:
    """A stand-in ``vllm.entrypoints.openai.api_server`` module under ``root`` (put ``root`` on ``PYTHONPATH``)."""
    module = root / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", module):
        (d / "__init__.py").write_text("")
    (module / "api_server.py").write_text(api_server)


def test_launch_returns_before_the_server_answers_and_wait_ready_waits_for_it(tmp_path) -> None:
    # a stand-in for vLLM's API server module (the core environment has no vLLM): it answers /v1/models
    # after a delay, as a starting server does
    _fake_vllm(tmp_path, FAKE_SERVER)
    server = VLLMServer("fake", args=["--delay", "2"], python=sys.executable, env={"PYTHONPATH": str(tmp_path)},
                        startup_timeout=120, log_path=tmp_path / "fake.log")
    with pytest.raises(ServerError, match="was not launched"):
        server.wait_ready()
    try:
        assert server.launch() is server and server.alive()
        with pytest.raises(Unreachable):  # launched, not answering yet
            http_json(server.url("/v1/models"), timeout=5, retry=RetryPolicy(attempts=1))
        assert server.wait_ready() is server
        assert http_json(server.url("/v1/models"), timeout=5)[0] == 200
        assert server.wait_ready() is server  # ready already: returns at once
    finally:
        server.stop()
    assert not server.alive()
    with pytest.raises(ServerError, match="was not launched"):
        server.wait_ready()


def test_a_launched_server_that_exits_is_an_error_with_its_log() -> None:
    server = VLLMServer("/nonexistent/model", python=sys.executable, startup_timeout=60).launch()
    with pytest.raises(ServerError, match=r"(?s)exited with code \d+.*No module named 'vllm'"):
        server.wait_ready()
    assert not server.alive()


class Flaky:
    """What the test server does: ``failures[path]`` is a list of what the next requests get
    (an HTTP status, ``"drop"`` for a closed connection, ``"slow"`` for an answer after the timeout)."""

    def __init__(self) -> None:
        self.failures: dict[str, list[int | str]] = {}
        self.seen: list[tuple[str, str, dict, str | None]] = []  # method, path, body, Authorization
        self.retry_after: str | None = None
        self.break_stream_after: int | None = None
        self.lock = threading.Lock()


def _handler(state: Flaky) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, body: object, headers: dict[str, str] | None = None) -> None:
            out = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(out)

        def _handle(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            with state.lock:
                state.seen.append((method, self.path, body, self.headers.get("Authorization")))
                pending = state.failures.get(self.path) or []
                what = pending.pop(0) if pending else None
            if what == "drop":
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if what == "slow":
                time.sleep(0.6)
            elif what is not None:
                headers = {"Retry-After": state.retry_after} if state.retry_after else {}
                self._send(int(what), {"error": {"message": f"failing on purpose ({what})"}}, headers)
                return
            if self.path == "/v1/models":
                self._send(200, {"data": [{"id": "m", "max_model_len": 64}]})
            elif self.path == "/v1/chat/completions" and body.get("stream"):
                self._stream(body)
            elif self.path == "/v1/chat/completions":
                if body.get("bad"):
                    self._send(400, {"error": {"message": "bad request on purpose"}})
                else:
                    self._send(200, {"choices": [{"message": {"content": "hello"}}], "echo": body})
            elif self.path == "/v1/text":
                out = b"not json"
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
            else:
                self._send(404, {"detail": "no such path"})

        def _stream(self, body: dict) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            words = ["Grüezi", " mit", "enand"]
            for i, w in enumerate(words):
                if state.break_stream_after is not None and i == state.break_stream_after:
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                chunk = {"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
                if i == 0:
                    chunk["choices"][0]["delta"]["tool_calls"] = [{"index": 0, "function": {"name": "f", "arguments": "{"}}]
                elif i == 1:
                    chunk["choices"][0]["delta"]["tool_calls"] = [{"index": 0, "function": {"arguments": "}"}}]
                # events split over writes and separated as servers do
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            self.wfile.write(f": a comment line\ndata: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self._handle("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._handle("POST")

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def flaky() -> Iterator[tuple[Flaky, str]]:
    state = Flaky()
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), _handler(state))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_requests_are_retried_on_retryable_statuses_and_dropped_connections(flaky) -> None:
    state, url = flaky
    state.failures["/v1/chat/completions"] = [503, "drop", 429]
    with Client(url, retry=RetryPolicy(attempts=4, backoff=0.01)) as client:
        body = client.json("POST", "/chat/completions", {"x": 1})
    assert body["choices"][0]["message"]["content"] == "hello"
    assert [s[1] for s in state.seen] == ["/v1/chat/completions"] * 4  # three failures, then the answer


def test_a_retryable_status_that_persists_is_the_answer_and_other_statuses_are_not_retried(flaky) -> None:
    state, url = flaky
    state.failures["/v1/chat/completions"] = [502, 502, 502]
    with Client(url, retry=FAST) as client:
        with pytest.raises(ResponseError, match=r"answered HTTP 502: failing on purpose \(502\)") as info:
            client.json("POST", "/chat/completions", {})
        assert info.value.status == 502 and len(state.seen) == 3
        state.seen.clear()
        with pytest.raises(ResponseError, match="HTTP 400: bad request on purpose"):
            client.json("POST", "/chat/completions", {"bad": True})
        assert len(state.seen) == 1  # a bad request does not get better by repeating it
        assert client.request("GET", "/nowhere").status == 404 and len(state.seen) == 2
        with pytest.raises(ResponseError, match="did not answer JSON"):
            client.json("GET", "/text")
    assert 404 not in RETRY_STATUSES and 400 not in RETRY_STATUSES


def test_retry_after_is_honoured(flaky) -> None:
    state, url = flaky
    state.failures["/v1/models"] = [429]
    state.retry_after = "0.3"
    t0 = time.monotonic()
    with Client(url, retry=RetryPolicy(attempts=2, backoff=0.0)) as client:
        assert client.models()[0]["id"] == "m"
    assert time.monotonic() - t0 >= 0.3
    assert RetryPolicy(max_backoff=2.0).delay(0, "3600") == 2.0  # capped
    assert RetryPolicy(backoff=0.5).delay(2) == 2.0  # doubling


def test_timeouts_are_retried_and_an_unreachable_server_names_the_url(flaky) -> None:
    state, url = flaky
    state.failures["/v1/models"] = ["slow"]
    with Client(url, timeout=0.3, retry=FAST) as client:
        assert client.models()[0]["id"] == "m"
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with Client(dead, retry=FAST) as client, pytest.raises(
            Unreachable, match=rf"no answer from {dead}/models after 3 attempts \(timeout 60 s each\): Connect"):
        client.models()
    with pytest.raises(Unreachable):
        http_json(dead + "/models", retry=FAST)


def test_the_api_key_goes_with_every_request(flaky, monkeypatch: pytest.MonkeyPatch) -> None:
    state, url = flaky
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with Client(url) as client:
        client.models()
    with Client(url, api_key="sk-given") as client:
        client.models()
        list(client.stream("/chat/completions", {}))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    with Client(url) as client:
        client.json("POST", "/chat/completions", {})
    assert [s[3] for s in state.seen] == [None, "Bearer sk-given", "Bearer sk-given", "Bearer sk-from-env"]


def test_http_json_returns_status_and_body_for_success_and_client_errors(flaky) -> None:
    _, url = flaky
    assert http_json(f"{url}/chat/completions", {"a": 1})[1]["echo"] == {"a": 1}
    assert http_json(f"{url}/chat/completions", {"bad": True}) == (400, {"error": {"message": "bad request on purpose"}})
    assert http_json(f"{url}/models") == (200, {"data": [{"id": "m", "max_model_len": 64}]})


def test_streaming_yields_each_event_and_assembles_the_answer(flaky) -> None:
    state, url = flaky
    with Client(url, retry=FAST) as client:
        chunks = list(client.stream("/chat/completions", {"model": "m"}))
    assert state.seen[-1][2] == {"model": "m", "stream": True}
    assert len(chunks) == 4 and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    whole = assemble(chunks)
    assert whole == {"content": "Grüezi mitenand", "reasoning": "", "finish_reason": "stop",
                     "tool_calls": [{"name": "f", "arguments": "{}"}]}


def test_a_stream_is_retried_before_its_first_event_never_after(flaky) -> None:
    state, url = flaky
    state.failures["/v1/chat/completions"] = [503, "drop"]
    with Client(url, retry=FAST) as client:
        assert assemble(list(client.stream("/chat/completions", {})))["content"] == "Grüezi mitenand"
        assert len(state.seen) == 3
        state.failures["/v1/chat/completions"] = [400]
        with pytest.raises(ResponseError, match="HTTP 400"):
            list(client.stream("/chat/completions", {}))
        state.seen.clear()
        state.break_stream_after = 2
        got = []
        with pytest.raises(Unreachable, match="broke after it began"):
            for chunk in client.stream("/chat/completions", {}):
                got.append(chunk)
        assert len(got) == 2 and len(state.seen) == 1  # what was received is not asked for again


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="http"):
        Client("127.0.0.1:8000")
    with pytest.raises(ValueError, match="attempts must be at least 1"):
        RetryPolicy(attempts=0)


def test_the_one_process_flags_bring_the_setting_vllms_cpu_platform_keeps_them_with(tmp_path, monkeypatch) -> None:
    """``ONE_PROCESS_ARGS`` asks for vLLM's ``uni`` executor, which vLLM's CPU platform replaces by ``mp`` unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0: the server is started with it; other servers are not."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    _fake_vllm(tmp_path, "import os\nprint('setting', os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING'))\n")
    seen = {}
    for name, args in {"uni": [*CPU_ARGS, *ONE_PROCESS_ARGS], "uni=": ["--distributed-executor-backend=uni"],
                       "cpu default": [*CPU_ARGS], "mp after uni": [*ONE_PROCESS_ARGS, "--distributed-executor-backend", "mp"]}.items():
        server = VLLMServer("fake", args=args, python=sys.executable, log_path=tmp_path / f"{name}.log",
                            env={"PYTHONPATH": str(tmp_path)})
        server.launch()
        server.proc.wait(60)
        seen[name] = server.log_tail().split()[-1]
    assert seen == {"uni": "0", "uni=": "0", "cpu default": "None", "mp after uni": "None"}
