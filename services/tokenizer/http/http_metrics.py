"""Every HTTP response counted by method, route and status, as it starts. The Generate calls'
own metrics see only requests that became one; this also sees the refusals before that (a body
that does not validate or is too large, a missing key), which an operator wants on a dashboard.
The route is the matched template, so ids in paths do not make new series."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

OTHER = "other"  # no route: an unknown path, or refused before routing (413 by Content-Length)


class HttpMetrics:
    def __init__(
        self, app: ASGIApp, count: Callable[[str, str, int], None], paths: Iterable[str]
    ) -> None:
        self.app, self.count = app, count
        self.paths = frozenset(p for p in paths if "{" not in p)  # routes without parameters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(scope["method"], self.route(scope), message["status"])
            await send(message)

        await self.app(scope, receive, counted)

    def route(self, scope: Scope) -> str:
        matched = getattr(scope.get("route"), "path", None)  # set by the router as it matched
        if isinstance(matched, str):
            return matched
        return scope["path"] if scope["path"] in self.paths else OTHER
