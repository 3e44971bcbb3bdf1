"""``sparrow serve``: an OpenAI-compatible HTTP server over one AsyncLLM.

    GET  /health               200, or 503 once the engine is dead
    GET  /metrics              Prometheus text (sparrow:* metrics)
    GET  /version              {"version": ...}
    GET  /v1/models            the served model
    POST /v1/completions       text or token-id prompts; stream: true for SSE
    POST /v1/chat/completions  chat messages through the tokenizer's chat template

``build_app(engine, args)`` makes the FastAPI app (tests drive it directly); ``run_server(args)``
binds the port, builds the engine from the engine flags and serves it with uvicorn until a signal
(exit code 0) or the engine core's death (exit code 1); see ``lifecycle``. ``add_serve_parser``
adds the ``serve`` subcommand to the ``sparrow`` CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparrow.engine.async_llm import AsyncLLM
from sparrow.engine.exceptions import EngineDeadError
from sparrow.engine.metrics import PROMETHEUS_CONTENT_TYPE, render
from sparrow.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from sparrow.entrypoints.openai.serving_chat import OpenAIServingChat
from sparrow.entrypoints.openai.serving_completion import OpenAIServingCompletion
from sparrow.entrypoints.openai.serving_engine import APIError, engine_dead

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 10 * 1024 * 1024
ENV_API_KEY = "SPARROW_API_KEY"
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}


def error_response(status_code: int, message: str, err_type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status_code, message, err_type, param, code).body(), status_code=status_code)


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes")


class RequestLimitsMiddleware:
    """Bearer auth on /v1/* and a cap on the request body, before any route reads the body.

    The cap is checked against Content-Length up front and against the bytes actually received
    (a chunked body has no Content-Length).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1") and not self._authorized(headers):
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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for error in exc.errors():
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        field = ".".join(location) or "body"
        # A body that is not JSON at all is located by character offset: no field to name.
        if location and not location[0].isdigit():
            param = param or location[0]
        parts.append(f"{field}: {error.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "BadRequestError", param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = {404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestTooLargeError"}.get(
            exc.status_code, "HTTPError")
        return error_response(exc.status_code, str(exc.detail), err_type)

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(engine_dead(exc).body(), status_code=503)


def build_app(engine: AsyncLLM, args: argparse.Namespace | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``. ``args`` may carry ``api_key`` and
    ``max_request_body_bytes``; missing attributes take their defaults."""
    from sparrow import __version__

    api_key = getattr(args, "api_key", None) or os.environ.get(ENV_API_KEY) or None
    max_body = getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_REQUEST_BODY_BYTES
    model_names = [engine.served_model_name]
    app = FastAPI(title="Sparrow OpenAI-compatible API", version=__version__)
    app.add_middleware(RequestLimitsMiddleware, api_key=api_key, max_body_bytes=max_body)
    _install_error_handlers(app)
    app.state.engine = engine
    completions = OpenAIServingCompletion(engine, model_names)
    chat = OpenAIServingChat(engine, model_names)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if engine.errored:
            return JSONResponse(engine_dead(engine.dead_error or EngineDeadError()).body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(engine.metrics), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.model_config.model,
                                         max_model_len=engine.model_config.max_model_len) for name in model_names])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    return app


def run_server(args: argparse.Namespace) -> int:
    """Bind the port, build the engine from the parsed flags and serve; return the exit code."""
    import uvicorn

    from sparrow.entrypoints.cli import engine_kwargs
    from sparrow.entrypoints.openai.lifecycle import RequestTracker, Server, bind_listeners

    kwargs = engine_kwargs(args)
    model_pos = getattr(args, "model_pos", None)
    if model_pos is not None:
        if kwargs.get("model") not in (None, model_pos):
            raise SystemExit(f"sparrow serve: MODEL {model_pos!r} and --model {kwargs['model']!r} disagree")
        kwargs["model"] = model_pos
    sockets = bind_listeners(args.host, args.port)
    # While the model loads, SIGTERM is an exception (as SIGINT is), so that whatever has started
    # is shut down rather than orphaned. Once serving, lifecycle.Server handles both signals.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        engine = AsyncLLM.from_engine_args(**kwargs)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    try:
        tracker = RequestTracker(build_app(engine, args))
        config = uvicorn.Config(tracker, log_level=args.uvicorn_log_level, access_log=not args.disable_access_log,
                                # A backstop only: requests are ended before uvicorn shuts down.
                                timeout_graceful_shutdown=5)
        server = Server(config, engine, tracker, args.shutdown_timeout)
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            return runner.run(server.serve_sockets(sockets))
    finally:
        engine.shutdown()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _shutdown_timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
    return seconds


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sparrow serve [MODEL]`` with server flags and every engine argument."""
    from sparrow.entrypoints.cli import add_engine_args

    from sparrow.entrypoints.openai.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (see docs/serving.md). The process exits "
                    "with code 0 after SIGTERM or Ctrl+C, and with code 1 when the engine core dies.")
    parser.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                        help="local model directory (default: the built-in sparrow-tiny)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 for every IPv4 interface (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000,
                        help="TCP port to listen on; checked before the model loads (default: 8000)")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${ENV_API_KEY} if set, "
                             "else no authentication)")
    server.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help=f"answer larger request bodies with 413 (default: {DEFAULT_MAX_REQUEST_BODY_BYTES}, "
                             "10 MiB)")
    server.add_argument("--shutdown-timeout", type=_shutdown_timeout, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        metavar="SECONDS",
                        help="on SIGTERM or Ctrl+C, refuse new requests and let those in flight run this long; "
                             "then end the rest with an error (streams: an error event and [DONE]). 0 ends "
                             f"them at once, as vLLM does (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the HTTP server's own messages (default: info)")
    server.add_argument("--disable-access-log", action="store_true",
                        help="do not log one line per HTTP request (default: off, every request is logged)")
    add_engine_args(parser)
    parser.set_defaults(func=run_server)
    return parser
