"""A request body past the limit is refused with 413 before it is read whole: by its
Content-Length at once, a chunked one as soon as the bytes read pass the limit. Without it one
body of a few GB (parsing holds it several times over) could exhaust the tokenizer's memory and
end every request the process serves; the gRPC door has the same limit."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.tokenizer.http.errors import error_body


def _message(size: str, limit: int) -> str:
    return f"the body is {size} bytes; this server takes at most {limit}"


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a chunked body passes the limit: an HTTPException, so the
    framework's reading of the body passes it on to the app's handler as it is."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _message(f"more than {limit}", limit))


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if length.isdigit() and int(length) > self.limit:
            body = error_body(413, _message(length.decode(), self.limit))
            data = json.dumps(body, separators=(",", ":")).encode()
            headers = [(b"content-type", b"application/json")]
            headers.append((b"content-length", b"%d" % len(data)))
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return
        read = 0

        async def counted() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:
                raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)
