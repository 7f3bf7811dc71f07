"""The request-body bound of the admin API, as ASGI middleware.

A declared ``Content-Length`` over the bound (or one that is not a number) is refused before any
byte is read. A body without one (``Transfer-Encoding: chunked``) is counted as it arrives: the
chunk that passes the bound ends the read with a 413 problem document, so no body, however it
is sent, makes the server hold more than the bound.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cmx.api.problems import problem

__all__ = ["BodyLimit", "BodyTooLarge"]


class BodyTooLarge(HTTPException):
    """Raised from ``receive``: an HTTPException, so the body parser passes it on unchanged and
    the app's handlers answer it with a problem document."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"a request body is at most {limit} bytes")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            detail = BodyTooLarge(self.max_bytes).detail
            await problem(413, detail, path=scope.get("path"))(scope, receive, send)
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as exc:
            # Where no handler answered it (a read outside the routes): answer here if we can.
            if started:
                raise
            await problem(413, exc.detail, path=scope.get("path"))(scope, receive, send)


def _content_length(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return str(value.decode("latin-1"))
    return None
