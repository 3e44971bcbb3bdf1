"""vLLM's development endpoints, served only with ``SPARROW_SERVER_DEV_MODE=1`` (vLLM:
``VLLM_SERVER_DEV_MODE``): an RLHF trainer drives a colocated server with them.

    POST /reset_prefix_cache                     -> 200
    POST /sleep?level=1                          -> 200   (enable_sleep_mode=True)
    POST /wake_up?tags=weights&tags=kv_cache     -> 200   (no tags: both)
    GET  /is_sleeping                            -> {"is_sleeping": bool}
    POST /pause?mode=abort&clear_cache=true      -> 200   (mode: abort, wait or keep; sparrow.engine.core_pause)
    POST /resume                                 -> 200
    GET  /is_paused                              -> {"is_paused": bool}
    POST /collective_rpc {"method", "args", "kwargs", "timeout"} -> {"results": [...]}

``collective_rpc`` takes a worker method's name only (no functions over HTTP); its results must
be JSON values. A refused argument is a 400 in OpenAI's error shape naming it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from sparrow.entrypoints.openai.api_errors import APIError

logger = logging.getLogger(__name__)

ENV_DEV_MODE = "SPARROW_SERVER_DEV_MODE"


class CollectiveRpcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: str = Field(..., min_length=1, description="a worker method's name")
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0, description="seconds before the call fails")


def dev_mode() -> bool:
    return os.environ.get(ENV_DEV_MODE, "0").lower() in ("1", "true")


def add_dev_routes(app: Any, engine: Any) -> None:
    logger.warning("%s is set: the development endpoints (/sleep, /wake_up, /pause, /collective_rpc, ...) are served; "
                   "do not expose this server to untrusted clients", ENV_DEV_MODE)

    async def call(coro: Any, param: str) -> Any:
        try:
            return await coro
        except ValueError as exc:
            raise APIError(400, str(exc), "BadRequestError", param=param) from None
        except TimeoutError as exc:
            raise APIError(504, str(exc), "TimeoutError", param=param) from None
        except (AttributeError, RuntimeError) as exc:  # RuntimeError: a failure in the engine core's process
            unknown = "has no method" in str(exc) or "private attribute" in str(exc)
            raise APIError(400 if unknown else 500, str(exc), "BadRequestError" if unknown else "InternalServerError",
                           param=param) from None

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        await call(engine.sleep(level), "level")
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> Response:
        await call(engine.wake_up(tags), "tags")
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> Response:
        # Returns once the requests in flight have ended (abort, wait), or are frozen (keep).
        await call(engine.pause_generation(mode=mode, clear_cache=clear_cache), "mode")
        return Response(status_code=200)

    @app.post("/resume")
    async def resume() -> Response:
        await engine.resume_generation()
        return Response(status_code=200)

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    @app.post("/collective_rpc")
    async def collective_rpc(request: CollectiveRpcRequest) -> Response:
        results = await call(engine.collective_rpc(request.method, request.timeout, tuple(request.args),
                                                   request.kwargs), "method")
        try:
            return JSONResponse({"results": results})
        except (TypeError, ValueError) as exc:
            raise APIError(500, f"collective_rpc: {request.method!r} returned a value that is not JSON: {exc}",
                           "InternalServerError", param="method") from None
