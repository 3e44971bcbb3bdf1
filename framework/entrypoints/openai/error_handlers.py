"""How an exception a route raises becomes an error response in OpenAI's shape, and vLLM's
``--log-error-stack``: the stack behind every error response, logged at ERROR.

A route answers a bad request by raising ``APIError`` (usually ``raise bad_request(exc) from
None``, so the client sees one message); with ``--log-error-stack`` the log shows the exception it
was made from too, where the check that failed lives.
"""

from __future__ import annotations

import logging
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparrow.engine.exceptions import EngineDeadError
from sparrow.entrypoints.openai.http_guards import error_response
from sparrow.entrypoints.openai.request_checks import validation_message
from sparrow.entrypoints.openai.serving_engine import APIError, bad_request, engine_dead

logger = logging.getLogger(__name__)


def error_stack(exc: BaseException) -> str:
    """``exc``'s traceback, preceded by those of the exceptions it was raised from or while
    handling, a context hidden by ``from None`` included."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    parts = ["".join(traceback.format_exception(type(e), e, e.__traceback__, chain=False)) for e in reversed(chain)]
    return "\nwhich was answered as:\n\n".join(parts)


def log_error_stack(enabled: bool, status_code: int, exc: BaseException) -> None:
    """With --log-error-stack, log the stack behind an error response of ``status_code``."""
    if enabled:
        logger.error("error response %d: %s\n%s", status_code, exc, error_stack(exc))


def stream_error(exc: EngineDeadError | ValueError, enabled: bool) -> APIError:
    """The error a stream that already started ends with: 503 for a dead engine, else 400 (the
    engine core rejected a request); its stack logged with --log-error-stack (``enabled``)."""
    error = engine_dead(exc) if isinstance(exc, EngineDeadError) else bad_request(exc)
    log_error_stack(enabled, error.status_code, exc)
    return error


def install_error_handlers(app: FastAPI) -> None:
    """Answer APIError, FastAPI's validation errors, Starlette's HTTP errors and a dead engine in
    OpenAI's error shape; ``app.state.log_error_stack`` logs their stacks."""

    def logged(exc: BaseException, status_code: int) -> None:
        log_error_stack(getattr(app.state, "log_error_stack", False), status_code, exc)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        logged(exc, exc.status_code)
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        logged(exc, 400)
        message, param = validation_message(exc.errors())
        return error_response(400, message, "BadRequestError", param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        logged(exc, exc.status_code)
        err_type = {404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestTooLargeError"}.get(
            exc.status_code, "HTTPError")
        # A chunked body over the cap is found while it is read, and ends up here.
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(exc.status_code, str(exc.detail), err_type, code=code)

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        logged(exc, 503)
        return JSONResponse(engine_dead(exc).body(), status_code=503)
