"""The HTTP server's guards around every request, before a route sees it: the header count cap,
the API key and the body size cap (RequestLimitsMiddleware), the JSON body parsed with a 400 that says what is wrong
(JSONBodyRoute), CORS preflights refused in OpenAI's error shape (CORSGuard), and the
X-Request-Id response header (RequestIdHeaderMiddleware). The requests in flight (for GET /load
and a graceful shutdown) are counted by ``lifecycle.RequestTracker``."""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparrow.entrypoints.openai.serving_engine import APIError

# Paths the API key guards besides /v1/*: the tokenizer endpoints cost input-thread time and show
# the chat template; vLLM's classify, pooling, score, rerank and invocations paths outside /v1 run
# the model.
_GUARDED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info", "/classify", "/pooling", "/score",
                            "/rerank", "/v2/rerank", "/invocations"})


def route_path(scope: Scope) -> str:
    """The path the app routes by: without the root path (--root-path) that uvicorn puts in front
    of it (as Starlette's routing strips it)."""
    path: str = scope["path"]
    root = scope.get("root_path") or ""
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


def error_response(status_code: int, message: str, err_type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status_code, message, err_type, param, code).body(), status_code=status_code)


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes")


class RequestLimitsMiddleware:
    """A cap on the number of header fields (vLLM's --h11-max-header-count: a 431), Bearer auth
    on /v1/* and the tokenizer endpoints, and a cap on the request body, before any route reads
    the body. (CORS preflight requests never get here: CORSMiddleware, outside
    this one, answers them, as browsers send them without credentials.)

    The cap is checked against Content-Length up front and against the bytes actually received
    (a chunked body has no Content-Length).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 max_header_count: int | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_header_count = max_header_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.max_header_count is not None and len(scope["headers"]) > self.max_header_count:
            response = error_response(431, f"the request has {len(scope['headers'])} header fields, more than the "
                                           f"limit of {self.max_header_count} (--h11-max-header-count)",
                                      "RequestHeaderFieldsTooLargeError", code="too_many_headers")
            await response(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        path = route_path(scope)
        guarded = path.startswith("/v1") or path in _GUARDED_PATHS
        if self.api_key is not None and guarded and not self._authorized(headers):
            response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                      "AuthenticationError", code="invalid_api_key")
            await response(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        received = 0
        limit = self.max_body_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"the request body is larger than the limit of {self.max_body_bytes} bytes",
                                  "RequestTooLargeError", code="request_too_large")
        await response(scope, receive, send)


def _body_error(message: str) -> APIError:
    return APIError(400, message, "BadRequestError", code="invalid_value")


def parse_json_body(body: bytes, headers: Headers) -> Any:
    """A request body as JSON, or a 400 saying what is wrong with it.

    The body must be sent as ``Content-Type: application/json`` (or a ``+json`` type): a form or
    text/plain body, or one without a Content-Type, is what a web page may send to another
    origin without a CORS preflight, so reading those as JSON would let any page make this
    server generate, whatever --allowed-origins says (FastAPI's strict_content_type reasoning).
    """
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _body_error(f"Content-Encoding {encoding!r} is not supported: send the body uncompressed")
    content_type = headers.get("content-type")
    main_type, _, subtype = (content_type or "").partition(";")[0].strip().lower().partition("/")
    if main_type != "application" or not (subtype == "json" or subtype.endswith("+json")):
        got = f"got {content_type!r}" if content_type else "there was none"
        raise _body_error(f"the request body must be JSON sent with the header 'Content-Type: application/json' "
                          f"({got})")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _body_error(f"the request body is not valid UTF-8: byte 0x{body[exc.start]:02x} at position "
                          f"{exc.start} ({exc.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _body_error(f"the request body is not valid JSON: {exc.msg} at position {exc.pos} (line {exc.lineno}, "
                          f"column {exc.colno})") from None
    except RecursionError:
        raise _body_error("the request body is not valid input: its JSON nests arrays or objects too deeply") from None
    except ValueError:  # Python's cap on the digits of an integer read from text
        raise _body_error(f"the request body is not valid input: it holds an integer of more than "
                          f"{sys.get_int_max_str_digits()} digits") from None


class _ParsedRequest(Request):
    """A request whose body was read and parsed already: FastAPI gets the parsed JSON."""

    def __init__(self, request: Request, body: bytes, parsed: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._raw_body, self._parsed = body, parsed

    async def body(self) -> bytes:
        return self._raw_body

    async def json(self) -> Any:
        return self._parsed


class JSONBodyRoute(APIRoute):
    """A route whose JSON body is parsed here, so that every malformed body (not JSON, not
    UTF-8, compressed, nested past the recursion limit, ...) is a 400 in OpenAI's shape saying
    what is wrong, where FastAPI answers some with "There was an error parsing the body"."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle

        async def parse_then_handle(request: Request) -> Response:
            body = await request.body()  # RequestLimitsMiddleware's cap applies while reading
            if not body:
                return await handle(request)  # FastAPI reports the missing body
            return await handle(_ParsedRequest(request, body, parse_json_body(body, request.headers)))

        return parse_then_handle


class CORSGuard(CORSMiddleware):
    """Starlette's CORS, except that a refused preflight is a 400 in OpenAI's error shape with no
    CORS headers at all (Starlette's still allows the methods, credentials and, for a refused
    method, the origin)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        asked = {"origin": f"origin {request_headers.get('origin')!r} (--allowed-origins)",
                 "method": f"method {request_headers.get('access-control-request-method')!r} (--allowed-methods)",
                 "headers": f"headers {request_headers.get('access-control-request-headers')!r} (--allowed-headers)",
                 "private-network": "private network access"}
        # Starlette's body names what failed: "Disallowed CORS origin, method".
        failures = bytes(response.body).decode().removeprefix("Disallowed CORS ").split(", ")
        refused = ", ".join(asked.get(failure, failure) for failure in failures)
        return error_response(400, f"CORS preflight refused; not allowed: {refused}", "BadRequestError",
                              code="cors_refused")


class RequestIdHeaderMiddleware:
    """--enable-request-id-headers (vLLM's): every response carries ``X-Request-Id``, the request's
    own header when it sent one, else a new random id (32 hex digits)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or secrets.token_hex(16)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", [])
                           if name.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)
