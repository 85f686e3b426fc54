"""A scriptable OpenAI-compatible HTTP server on 127.0.0.1 (the endpoint of tests, examples, chaos runs), for
the real ``openai`` client. A *script* decides each reply::

    def script(request: dict, n: int) -> Reply | str:   # n = 0-based index of this request
        return "Final: 42"                               # a plain string is the assistant content

    with ScriptedServer(script) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="test")

A :class:`Reply` can also set an HTTP status, headers, a delay, a raw body or tool calls; request bodies are
recorded in ``server.requests``."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: OpenAI error ``type`` by HTTP status; any other status is a ``server_error``.
STATUS_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}


@dataclass
class Reply:
    """One scripted answer to a chat-completions request."""

    content: str | None = ""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    raw_body: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    prompt_tokens: int = 10
    completion_tokens: int = 5


Script = Callable[[dict[str, Any], int], "Reply | str"]


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # a burst of concurrent clients must not wait for TCP SYN retries
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up (a reset, a broken pipe) ends its connection; it is no server fault. The base
        # class prints a traceback to sys.stderr, whatever that is then (a test capturing a CLI's stderr).
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def completion_body(request: dict[str, Any], reply: Reply) -> dict[str, Any]:
    """The JSON body of a successful chat completion for ``reply`` (``n`` copies of the message)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    finish = "tool_calls" if reply.tool_calls else "stop"
    n = int(request.get("n") or 1)
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex[:12],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model", "scripted"),
        "choices": [
            {"index": i, "message": message, "finish_reason": finish, "logprobs": None} for i in range(n)
        ],
        "usage": {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens * n,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens * n,
        },
    }


class ScriptedServer:
    """Serve ``/v1/models`` and ``/v1/chat/completions`` on 127.0.0.1 (a free port), answering by ``script``."""

    def __init__(self, script: Script | str = "", *, model: str = "scripted") -> None:
        self.script: Script = (lambda req, n: script) if isinstance(script, str) else script
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``."""
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    @property
    def calls(self) -> int:
        """Number of chat-completion requests received."""
        return len(self.requests)

    def start(self) -> ScriptedServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
                return

            def _send(self, status: int, payload: str, headers: dict[str, str] | None = None) -> None:
                data = payload.encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(data)

            def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
                err = {"message": message, "type": STATUS_TYPES.get(status, "server_error"), "code": None}
                self._send(status, json.dumps({"error": {**err, "param": None}}), headers)

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    model = {"id": server.model, "object": "model", "owned_by": "test"}
                    self._send(200, json.dumps({"object": "list", "data": [model]}))
                else:
                    self._error(404, "not found")

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    return self._error(404, "not found")
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    return self._error(400, "body is not JSON")
                with server._lock:
                    n = len(server.requests)
                    server.requests.append(body)
                reply = server.script(body, n)
                if isinstance(reply, str):
                    reply = Reply(content=reply)
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.raw_body is not None:
                    self._send(reply.status, reply.raw_body, reply.headers)
                elif reply.status != 200:
                    self._error(reply.status, reply.content or f"scripted {reply.status}", reply.headers)
                else:
                    self._send(200, json.dumps(completion_body(body, reply)), reply.headers)

        self._httpd = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._httpd.serve_forever, name="scripted-openai", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
