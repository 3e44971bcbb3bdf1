"""``sparrow serve``: an OpenAI-compatible HTTP server over one AsyncLLM.

    GET  /health               200, or 503 once the engine is dead
    GET  /metrics              Prometheus text (sparrow:* metrics)
    GET  /version              {"version": ...}
    GET  /load                 {"server_load": generation requests in flight} (vLLM's; counted with
                               --enable-server-load-tracking)
    GET  /v1/models            the served model
    GET  /v1/models/{id}       its model card (404 model_not_found for another id)
    POST /v1/completions       text or token-id prompts; stream: true for SSE
    POST /v1/chat/completions  chat messages through the tokenizer's chat template
    POST /v1/responses         OpenAI's Responses API on the chat machinery (serving_responses)
    GET, DELETE /v1/responses/{id}  a stored response (store: true, the default); GET stream=true
                               resumes a background stream
    POST /v1/responses/{id}/cancel  cancels a background response (background: true)
    GET  /v1/responses/{id}/input_items  its input items, paginated
    POST /v1/embeddings        one vector per input, from a pooling model (--runner pooling); the
                               generation endpoints are 400s on such a model, this one on the others
    POST /classify             vLLM's: class probabilities per input, from a sequence classifier
    POST /pooling              vLLM's: any pooling task's raw output (per token for token_embed/_classify)
    POST /invocations, /ping   vLLM's SageMaker routes: a body routed by its fields; the health check
    POST /score, /v1/score     vLLM's: text pairs' scores: their vectors' cosine similarity, or a cross-encoder's
    POST /rerank, /v1/rerank, /v2/rerank  vLLM's (Jina's and Cohere's shape): documents ranked by
                               that score against a query
    POST /tokenize             text or chat messages -> token ids, as the endpoints above tokenize them
    POST /detokenize           token ids -> text
    GET  /tokenizer_info       the tokenizer's configuration (special tokens, chat template, ...)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   with --enable-lora and
                               SPARROW_ALLOW_RUNTIME_LORA_UPDATING=true (serving_models)
    POST /start_profile, /stop_profile   with SPARROW_TORCH_PROFILER_DIR set: torch.profiler in
                               every worker, a Chrome trace per rank there (stop returns summaries)

Every route answers CORS preflight requests (--allowed-origins, --allowed-methods, ...).

``build_app(engine, args)`` makes the FastAPI app (tests drive it directly); ``run_server(args)``
binds the port, builds the engine from the engine flags and serves it with uvicorn until a signal
(exit code 0) or the engine core's death (exit code 1); see ``lifecycle``. The ``serve`` flags are
in ``cli_args``, which the ``sparrow`` CLI imports without this module's server stack.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from sparrow.engine.async_llm import AsyncLLM
from sparrow.engine.metrics import PROMETHEUS_CONTENT_TYPE, render
from sparrow.entrypoints.openai.cli_args import (  # noqa: F401 - add_serve_parser: re-exported
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ENV_API_KEY,
    ENV_PROFILER_DIR,
    add_serve_parser,
)
from sparrow.entrypoints.openai.error_handlers import install_error_handlers
from sparrow.entrypoints.openai.http_guards import (
    CORSGuard,
    JSONBodyRoute,
    RequestIdHeaderMiddleware,
    RequestLimitsMiddleware,
)
from sparrow.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from sparrow.entrypoints.openai.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from sparrow.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from sparrow.entrypoints.openai.request_logger import request_logger_from_args
from sparrow.entrypoints.openai.server_flags import DEFAULT_MAX_HEADER_COUNT
from sparrow.entrypoints.openai.serving_chat import OpenAIServingChat, check_default_template_kwargs
from sparrow.entrypoints.openai.serving_classify import OpenAIServingClassify, add_classify_routes
from sparrow.entrypoints.openai.serving_completion import OpenAIServingCompletion
from sparrow.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from sparrow.entrypoints.openai.serving_invocations import add_health_and_sagemaker_routes
from sparrow.entrypoints.openai.serving_models import (
    add_lora_routes,
    add_model_routes,
    lora_modules_from_args,
    runtime_lora_updating,
)
from sparrow.entrypoints.openai.serving_pooling import OpenAIServingPooling, add_pooling_routes
from sparrow.entrypoints.openai.serving_responses import OpenAIServingResponses
from sparrow.entrypoints.openai.serving_score import OpenAIServingScore, add_score_routes
from sparrow.entrypoints.openai.serving_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    OpenAIServingTokenization,
    TokenizeResponse,
    TokenizerInfoResponse,
    parse_tokenize_request,
)

logger = logging.getLogger(__name__)

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}


def build_app(engine: AsyncLLM, args: argparse.Namespace | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``. ``args`` may carry ``api_key``, ``max_request_body_bytes``,
    the CORS flags, ``chat_template``, ``chat_template_content_format``, ``response_role``, ``enable_log_requests``,
    ``enable_log_outputs`` and ``max_log_len``; missing attributes take their defaults. (``root_path`` is uvicorn's: see
    ``run_server``.)"""
    from sparrow import __version__

    api_key = getattr(args, "api_key", None) or os.environ.get(ENV_API_KEY) or None
    max_body = getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_REQUEST_BODY_BYTES
    model_names = [engine.served_model_name]
    docs = not getattr(args, "disable_fastapi_docs", False)
    app = FastAPI(title="Sparrow OpenAI-compatible API", version=__version__, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.router.route_class = JSONBodyRoute  # before any route is added
    app.add_middleware(RequestLimitsMiddleware, api_key=api_key, max_body_bytes=max_body,
                       max_header_count=getattr(args, "h11_max_header_count", None) or DEFAULT_MAX_HEADER_COUNT)
    # Added last, so outermost: preflights are answered before auth, and every response (a 401
    # too) carries the CORS headers a browser needs to read it.
    cors = {name: ["*"] if getattr(args, name, None) is None else getattr(args, name)
            for name in ("allowed_origins", "allowed_methods", "allowed_headers")}
    app.add_middleware(CORSGuard, allow_origins=cors["allowed_origins"], allow_methods=cors["allowed_methods"],
                       allow_headers=cors["allowed_headers"],
                       allow_credentials=bool(getattr(args, "allow_credentials", False)))
    if getattr(args, "enable_request_id_headers", False):  # outermost: every response, a 401 too
        app.add_middleware(RequestIdHeaderMiddleware)
    # Around the whole app (run_server serves it): the requests in flight, for a graceful shutdown
    # and GET /load (0 unless --enable-server-load-tracking counts the generation requests).
    from sparrow.entrypoints.openai.lifecycle import RequestTracker

    app.state.request_tracker = RequestTracker(
        app, track_load=bool(getattr(args, "enable_server_load_tracking", False)))
    for middleware in getattr(args, "middleware", None) or ():  # --middleware, vLLM's: the user's own
        if isinstance(middleware, type):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
    install_error_handlers(app)
    app.state.log_error_stack = bool(getattr(args, "log_error_stack", False))
    default_template_kwargs = check_default_template_kwargs(engine, getattr(args, "default_chat_template_kwargs",
                                                                            None))
    app.state.engine = engine
    chat_template = getattr(args, "chat_template", None)
    completions = OpenAIServingCompletion(engine, model_names)
    content_format = getattr(args, "chat_template_content_format", None) or "auto"
    chat = OpenAIServingChat(engine, model_names, **chat_parsers(engine, args), chat_template=chat_template,
                             response_role=getattr(args, "response_role", None) or "assistant",
                             chat_template_content_format=content_format)
    tokenization = OpenAIServingTokenization(engine, model_names, chat_template=chat_template,
                                             chat_template_content_format=content_format)
    responses = OpenAIServingResponses(engine, model_names, reasoner=chat.reasoner, chat_template=chat_template,
                                       chat_template_content_format=content_format,
                                       tool_parser_cls=chat.tool_parser_cls, enable_auto_tools=chat.enable_auto_tools)
    embeddings = OpenAIServingEmbedding(engine, model_names)
    scores = OpenAIServingScore(engine, model_names)
    classify, pooling = OpenAIServingClassify(engine, model_names), OpenAIServingPooling(engine, model_names)
    lora_modules = lora_modules_from_args(engine, args)
    request_logger = request_logger_from_args(args)
    for handler in (completions, chat, tokenization, responses, embeddings, scores, classify, pooling):
        handler.lora_modules = lora_modules
        handler.request_logger = request_logger
        handler.return_tokens_as_token_ids = bool(getattr(args, "return_tokens_as_token_ids", False))
        handler.enable_prompt_tokens_details = bool(getattr(args, "enable_prompt_tokens_details", False))
        handler.enable_force_include_usage = bool(getattr(args, "enable_force_include_usage", False))
        handler.trust_request_chat_template = bool(getattr(args, "trust_request_chat_template", False))
        handler.log_error_stack = app.state.log_error_stack
        handler.default_chat_template_kwargs = default_template_kwargs
        handler.exclude_tools_when_tool_choice_none = bool(getattr(args, "exclude_tools_when_tool_choice_none",
                                                                   False))
    for handler in (embeddings, classify, pooling):  # their chat form renders as the chat endpoint does
        handler.chat_template, handler.chat_template_content_format = chat_template, content_format

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(engine.metrics), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the generation requests in flight (counted with --enable-server-load-tracking)."""
        return {"server_load": app.state.request_tracker.server_load}

    add_model_routes(app, engine, model_names, lora_modules, _ERROR_RESPONSES)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses", response_model=ResponseObject, responses=_ERROR_RESPONSES)
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERROR_RESPONSES)
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embeddings.create_embedding(request, raw_request)

    add_score_routes(app, scores, _ERROR_RESPONSES)
    add_classify_routes(app, classify, _ERROR_RESPONSES)
    add_pooling_routes(app, pooling, _ERROR_RESPONSES)
    add_health_and_sagemaker_routes(app, engine, dict(chat=chat, completions=completions, embeddings=embeddings,
                                                      classify=classify, scores=scores, pooling=pooling),
                                    _ERROR_RESPONSES)

    # Query values are taken as text and checked by the handler, so that a bad one is a 400 naming
    # it; include also as the openai client sends a list (include[]=...).
    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERROR_RESPONSES)
    async def retrieve_response(
            response_id: str, stream: str | None = Query(None, description="true: a background response's events "
                                                                           "(one created with stream true)"),
            starting_after: str | None = Query(None, description="With stream: the sequence_number to resume "
                                                                 "after"),
            include_obfuscation: str | None = Query(None, description="Only false"),
            include: list[str] | None = Query(None, description="Not supported"),
            include_list: list[str] | None = Query(None, alias="include[]", include_in_schema=False)) -> Response:
        return responses.retrieve(response_id, stream=stream, starting_after=starting_after,
                                  include=[*(include or ()), *(include_list or ())],
                                  include_obfuscation=include_obfuscation)

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_ERROR_RESPONSES)
    async def delete_response(response_id: str) -> DeletedResponse:
        return await responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=_ERROR_RESPONSES)
    async def cancel_response(response_id: str) -> Response:
        return JSONResponse(await responses.cancel(response_id))

    @app.get("/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=_ERROR_RESPONSES)
    async def list_input_items(
            response_id: str, limit: str | None = Query(None, description="1 to 100 (default 20)"),
            order: str | None = Query(None, description="asc or desc (default: desc, the last item first)"),
            after: str | None = Query(None, description="The id of the item to list after"),
            include: list[str] | None = Query(None, description="Not supported"),
            include_list: list[str] | None = Query(None, alias="include[]", include_in_schema=False)) -> Response:
        return JSONResponse(responses.input_items(response_id, limit=limit, order=order, after=after,
                                                  include=[*(include or ()), *(include_list or ())]))

    # The drain on shutdown waits for (then ends) the background responses as for requests in flight.
    app.state.request_tracker.background_work = responses.background.running

    # The body is one of two shapes (text or chat), told apart by its "messages" key.
    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: Any = Body(..., description="{prompt, add_special_tokens, return_token_strs} or "
                                                         "{messages, add_generation_prompt, tools, ...}")
                       ) -> TokenizeResponse:
        return await tokenization.create_tokenize(parse_tokenize_request(body))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.create_detokenize(request)

    # Always served (vLLM serves it only with --enable-tokenizer-info-endpoint, which is accepted
    # here): lm-evaluation-harness finds the server's tokenizer through it.
    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses=_ERROR_RESPONSES)
    async def get_tokenizer_info() -> TokenizerInfoResponse:
        return await tokenization.get_tokenizer_info()

    if lora_modules is not None and runtime_lora_updating():
        add_lora_routes(app, lora_modules)
    from sparrow.entrypoints.openai.dev_routes import add_dev_routes, dev_mode

    if dev_mode():
        add_dev_routes(app, engine)
    if os.environ.get(ENV_PROFILER_DIR):  # as vLLM: the routes exist only where traces have a home
        @app.post("/start_profile")
        async def start_profile() -> Response:
            await engine.start_profile()
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> list[dict[str, Any]]:
            return await engine.stop_profile()
    return app


def tool_parser_class(args: argparse.Namespace | None) -> type | None:
    """The --tool-call-parser's class (None when not set), after loading --tool-parser-plugin's
    file; ValueError naming the flag when the name is not registered or --enable-auto-tool-choice
    lacks a parser."""
    from sparrow.plugin_files import load_plugin_file
    from sparrow.plugins import get_registry, resolve_parser

    plugin_file = getattr(args, "tool_parser_plugin", None)
    if plugin_file is not None:
        load_plugin_file(plugin_file, "--tool-parser-plugin", "sparrow_register_tool_parsers")
    name = getattr(args, "tool_call_parser", None)
    if name is None:
        if getattr(args, "enable_auto_tool_choice", False):
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (registered: "
                             f"{', '.join(sorted(get_registry().tool_parsers))})")
        return None
    try:
        return resolve_parser("tool parser", name, get_registry().tool_parsers)
    except ValueError as exc:
        raise ValueError(f"--tool-call-parser: {exc}") from None


def chat_parsers(engine: AsyncLLM, args: argparse.Namespace | None) -> dict[str, Any]:
    """The chat endpoint's tool and reasoning parsers, from the flags and the engine's
    reasoning_parser (built with its tokenizer, so a tokenizer without the parser's tokens
    fails here, at start-up)."""
    from sparrow.plugins import get_registry, resolve_parser

    reasoner = None
    name = getattr(engine.model_config, "reasoning_parser", None)
    if name is not None:
        reasoner = resolve_parser("reasoning_parser", name, get_registry().reasoning_parsers)(engine.tokenizer)
    return {"tool_parser_cls": tool_parser_class(args), "reasoner": reasoner,
            "enable_auto_tools": bool(getattr(args, "enable_auto_tool_choice", False))}


def check_api_flags(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Check the flags ``add_api_flags`` adds (before the model loads) and return the engine's
    keyword arguments, the positional MODEL included."""
    from sparrow.entrypoints.cli import engine_kwargs

    tool_parser_class(args)  # a wrong parser name is reported before the model loads
    kwargs = engine_kwargs(args)
    if getattr(args, "lora_modules", None) and not kwargs.get("enable_lora"):
        raise SystemExit(f"{command}: --lora-modules needs --enable-lora")
    for flag in ("enable_log_outputs", "max_log_len"):
        if getattr(args, flag, None) not in (None, False) and not getattr(args, "enable_log_requests", False):
            raise ValueError(f"--{flag.replace('_', '-')} needs --enable-log-requests")
    if getattr(args, "disable_log_requests", False) and getattr(args, "enable_log_requests", False):
        raise ValueError("--disable-log-requests and --enable-log-requests contradict each other; give one")
    model_pos = getattr(args, "model_pos", None)
    if model_pos is not None:
        if kwargs.get("model") not in (None, model_pos):
            raise SystemExit(f"{command}: MODEL {model_pos!r} and --model {kwargs['model']!r} disagree")
        kwargs["model"] = model_pos
    return kwargs


def run_server(args: argparse.Namespace) -> int:
    """Bind the port, build the engine from the parsed flags and serve; return the exit code."""
    import uvicorn

    from sparrow.entrypoints.openai.lifecycle import Server, bind_listeners
    from sparrow.entrypoints.openai.server_flags import check_serve_flags

    # TLS and --log-config-file (applied now); the ``sparrow`` command checked them before importing
    # this module.
    uvicorn_kwargs = check_serve_flags(args)
    kwargs = check_api_flags(args, "sparrow serve")
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
        tracker = build_app(engine, args).state.request_tracker  # the app inside its request counter
        config = uvicorn.Config(tracker, access_log=not args.disable_access_log,
                                root_path=getattr(args, "root_path", "") or "", **uvicorn_kwargs,
                                # A backstop only: requests are ended before uvicorn shuts down.
                                timeout_graceful_shutdown=5)
        server = Server(config, engine, tracker, args.shutdown_timeout)
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            return runner.run(server.serve_sockets(sockets))
    finally:
        engine.shutdown()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)
