"""A request body past the limit is refused with 413 before it is read whole: by its
Content-Length at once, a chunked one as soon as the bytes read pass the limit. Without it one
body of a few GB (parsing holds it several times over) could exhaust the tokenizer's memory and
end every request the process serves; the gRPC door has the same limit.

A body that has not arrived whole within the time limit is refused with 408, and its connection
closed: a client trickling a byte a minute would otherwise hold a connection (and a request's
memory) for as long as it likes; uvicorn has no such limit of its own."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.tokenizer.http.errors import error_body


def _message(size: str, limit: int) -> str:
    return f"the body is {size} bytes; this server takes at most {limit}"


# The rest of a refused body is never read, so the connection cannot carry another request.
_CLOSE = {"Connection": "close"}


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a chunked body passes the limit: an HTTPException, so the
    framework's reading of the body passes it on to the app's handler as it is."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _message(f"more than {limit}", limit), _CLOSE)


class BodyTimedOut(HTTPException):
    """Raised from `receive` once the body's time is up, as BodyTooLarge is."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the body did not arrive whole within {timeout_s:g} s", _CLOSE)


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int, timeout_s: float = 0.0) -> None:
        """timeout_s: from the request's headers to its body's last byte (0: no limit)."""
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if length.isdigit() and int(length) > self.limit:
            body = error_body(413, _message(length.decode(), self.limit))
            data = json.dumps(body, separators=(",", ":")).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            headers.append((b"content-length", b"%d" % len(data)))
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return
        read = 0
        timeout_s = self.timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s else None

        async def counted() -> Message:
            nonlocal read, deadline
            if deadline is None:  # no limit, or the body is whole (a stream's later receives
                message = await receive()  # wait for the client's disconnect, however late)
            else:
                try:
                    message = await asyncio.wait_for(receive(), deadline - time.monotonic())
                except TimeoutError:
                    raise BodyTimedOut(timeout_s) from None
            if message["type"] != "http.request":
                return message
            read += len(message.get("body", b""))
            if read > self.limit:
                raise BodyTooLarge(self.limit)
            if not message.get("more_body", False):
                deadline = None
            return message

        await self.app(scope, counted, send)
