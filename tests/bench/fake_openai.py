"""A fake OpenAI-compatible server: `http.server` in a thread, streaming scripted SSE chunks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One request: an HTTP error, or chunks of text after delays (a usage chunk at the end)."""

    steps: tuple[tuple[float, str], ...] = ()  # (seconds to wait, text of the chunk)
    status: int = 200
    error: str = ""  # the error message of a non-200 reply
    usage_tokens: int | None = None  # completion tokens the server says; None: no usage chunk
    prompt_tokens: int = 7
    cached_tokens: int = 3
    finish: bool = True  # False: the stream just stops, no finish reason and no [DONE]


@dataclass
class FakeOpenAI:
    reply: Callable[[dict[str, Any]], Reply]
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    url: str = ""


def _chunk(body: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
    if "messages" in body:
        return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def _handler(fake: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            payload = json.dumps({"data": [{"id": "fake-model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake.paths.append(self.path)
            fake.bodies.append(body)
            reply = fake.reply(body)
            if reply.status != 200:
                payload = json.dumps({"error": {"message": reply.error}}).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            # A role-only first chunk, as chat servers send: it carries no token.
            if "messages" in body:
                self._send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for delay, text in reply.steps:
                time.sleep(delay)  # a handler thread, not async code
                self._send(_chunk(body, text, None))
            if not reply.finish:
                return
            self._send(_chunk(body, "", "length"))
            if reply.usage_tokens is not None:
                usage = {
                    "prompt_tokens": reply.prompt_tokens,
                    "completion_tokens": reply.usage_tokens,
                    "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
                }
                self._send({"choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")

        def _send(self, obj: dict[str, Any]) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

    return Handler


@contextmanager
def serve(reply: Callable[[dict[str, Any]], Reply]) -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(reply)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = True
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
