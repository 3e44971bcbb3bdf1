"""The health check (``GET /health``; vLLM's SageMaker ``GET``/``POST /ping`` is the same: 200, or
503 in OpenAI's error shape once the engine is dead) and SageMaker's ``POST /invocations``, which
serves any request body an endpoint of this model takes, routed by the fields it has:

    generative model   ``messages`` -> /v1/chat/completions, ``prompt`` -> /v1/completions
    pooling model      ``query`` with ``documents`` -> /rerank; a score side (``text_1``, ``queries``,
                       ``data_1``, ...) -> /score; ``task`` -> /pooling; ``input`` or ``messages``
                       -> /v1/embeddings (an embedding model), /classify (a sequence classifier)
                       or /pooling (a token classifier)

The body is then validated as that endpoint's request and handled by it, with its errors; a body
that fits none is a 400 saying which fields route it. The API key guards /invocations as it
guards the endpoints it reaches (http_guards._GUARDED_PATHS); /health and /ping are open.
"""

from __future__ import annotations

from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from sparrow.engine.exceptions import EngineDeadError
from sparrow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from sparrow.entrypoints.openai.protocol_classify import ClassificationRequest
from sparrow.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from sparrow.entrypoints.openai.protocol_pooling import PoolingRequest
from sparrow.entrypoints.openai.protocol_score import RerankRequest, ScoreRequest
from sparrow.entrypoints.openai.serving_engine import APIError, engine_dead

_SCORE_SIDES = ("text_1", "text_2", "queries", "data_1", "data_2", "items")


def invocation_route(body: dict[str, Any], pooling: Any) -> tuple[str, type[BaseModel]]:
    """(handler name, request model) for a body, as the fields it has route it."""
    if pooling is None:
        if "messages" in body:
            return "chat", ChatCompletionRequest
        if "prompt" in body:
            return "completions", CompletionRequest
        raise APIError(400, "invocations: this model generates text; send a chat completion request (with messages) "
                       "or a completion request (with prompt)", "BadRequestError", code="invalid_value")
    if "query" in body and "documents" in body:
        return "rerank", RerankRequest
    if any(side in body for side in _SCORE_SIDES):
        return "score", ScoreRequest
    if "task" in body:
        return "pooling", PoolingRequest
    if "input" in body or "messages" in body:
        if pooling.head == "embed":
            return "embeddings", EmbeddingRequest
        if "classify" in pooling.supported_tasks:
            return "classify", ClassificationRequest
        return "pooling", PoolingRequest
    raise APIError(400, "invocations: this model is a pooling model; send an embedding, classification or pooling "
                   "request (with input or messages), a score request (text_1 and text_2) or a rerank request "
                   "(query and documents)", "BadRequestError", code="invalid_value")


def add_health_and_sagemaker_routes(app: FastAPI, engine: Any, handlers: dict[str, Any],
                         error_responses: dict[int | str, dict[str, Any]]) -> None:
    """``handlers``: the serving objects by name (chat, completions, embeddings, classify, scores,
    pooling)."""
    calls = {
        "chat": lambda request, raw: handlers["chat"].create_chat_completion(request, raw),
        "completions": lambda request, raw: handlers["completions"].create_completion(request, raw),
        "embeddings": lambda request, raw: handlers["embeddings"].create_embedding(request, raw),
        "classify": lambda request, raw: handlers["classify"].create_classify(request, raw),
        "score": lambda request, raw: handlers["scores"].create_score(request, raw),
        "rerank": lambda request, raw: handlers["scores"].create_rerank(request, raw),
        "pooling": lambda request, raw: handlers["pooling"].create_pooling(request, raw),
    }

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    @app.get("/ping", responses={503: {"model": ErrorResponse}})
    @app.post("/ping", include_in_schema=False)
    async def health() -> Response:
        if engine.errored:
            return JSONResponse(engine_dead(engine.dead_error or EngineDeadError()).body(), status_code=503)
        return Response(status_code=200)

    @app.post("/invocations", responses=error_responses)
    async def invocations(raw_request: Request, body: dict[str, Any] = Body(...)) -> Response:
        name, model = invocation_route(body, engine.input_processor.pooling)
        try:
            request = model.model_validate(body)
        except ValidationError as exc:  # reported as the endpoint itself reports a bad body
            raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]) \
                from None
        return await calls[name](request, raw_request)
