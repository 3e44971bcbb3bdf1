"""Middleware for `sparrow serve --middleware` in the tests: one ASGI class, one HTTP function."""

from __future__ import annotations


class ServedBy:
    """An ASGI middleware class: adds ``X-Served-By: sparrow-test`` to every response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-served-by", b"sparrow-test")]}
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)


async def path_echo(request, call_next):
    """An HTTP middleware function: echoes the request's path in ``X-Path``."""
    response = await call_next(request)
    response.headers["x-path"] = request.url.path
    return response


NOT_MIDDLEWARE = 42
