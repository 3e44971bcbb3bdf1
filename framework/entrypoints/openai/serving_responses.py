"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it); GET and DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel and GET /v1/responses/{id}/input_items.

A request becomes a chat request (``responses_input``) and runs on the chat endpoint's machinery:
its checks, chat template, generation-config defaults, structured outputs (``text.format``),
SamplingParams, request logging and disconnect handling, and its tool calling (``tool_calling``:
tool_choice auto parsed with the server's --tool-call-parser, required and named generated under a
grammar; ``responses_tools``). Its output becomes OpenAI's output items (``responses_output``: a
message, function calls), whole or as a stream of OpenAI's events:

    response.created, response.in_progress (a background response: created "queued", in progress
                                           from the engine's first output)
    the items' events (responses_output), one response.output_text.delta per piece of text
    response.completed, or response.incomplete when the length limit ended it (as OpenAI sends it)

Errors found before the first event are ordinary HTTP errors; a failure while generating ends the
stream with an ``error`` event (OpenAI's error, naming the field) and ``response.failed``.

``store`` (the default, as in OpenAI's API) keeps a finished response with its conversation and
input items in ``responses_store.ResponseStore``: the last ``MAX_STORED_RESPONSES``, in memory,
gone with the server. ``background`` (with store) generates it in a task of the server, which
``responses_background`` runs, cancels and streams.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparrow.engine.exceptions import EngineDeadError
from sparrow.entrypoints.openai.chat_output import ReplyParsers
from sparrow.entrypoints.openai.error_handlers import stream_error
from sparrow.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from sparrow.entrypoints.openai.request_checks import RequestFieldError, check_unicode
from sparrow.entrypoints.openai.responses_background import FINISHED, BackgroundResponses, BackgroundRun
from sparrow.entrypoints.openai.responses_input import (
    Conversation,
    chat_request_of,
    check_request,
    conversation_of,
    in_responses_words,
    wants_logprobs,
)
from sparrow.entrypoints.openai.responses_output import Event, EventSequence, OutputBuilder, new_id
from sparrow.entrypoints.openai.responses_store import (
    MAX_STORED_RESPONSES,
    RUNNING,
    ResponseStore,
    StoredResponse,
    bad_param,
    input_items_of,
    list_input_items,
    not_found,
    query_bool,
    query_int,
)
from sparrow.entrypoints.openai.serving_chat import render_prompt, template_request
from sparrow.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    collect_final,
    field_error,
)
from sparrow.entrypoints.openai.streams import cancel_on_disconnect, merge_streams
from sparrow.entrypoints.openai.tool_calling import resolve_tool_choice, tool_structured_outputs
from sparrow.entrypoints.openai.tool_parsers.base import adjust_request
from sparrow.outputs import RequestOutput

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class Pending:
    """One response being generated: what its final object is made of besides the output."""

    request: ResponsesRequest
    response_id: str
    model: str
    created_at: int
    conversation: Conversation
    prompt_tokens: int
    temperature: float | None
    top_p: float | None
    cached_tokens: int = 0

    def response(self, status: str, builder: OutputBuilder | None = None,
                 error: ResponseError | None = None) -> ResponseObject:
        request = self.request
        text = request.text.model_dump(mode="json", by_alias=True, exclude_none=True) if request.text else None
        usage = None
        finished = builder is not None and status not in RUNNING
        if finished:
            output_tokens = len(builder.token_ids)
            usage = ResponseUsage(input_tokens=self.prompt_tokens,
                                  input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
                                  output_tokens=output_tokens,
                                  output_tokens_details=OutputTokensDetails(reasoning_tokens=builder.reasoning_tokens),
                                  total_tokens=self.prompt_tokens + output_tokens)
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, error=error, model=self.model,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            output=builder.items() if finished else [], usage=usage, background=bool(request.background),
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            max_tool_calls=request.max_tool_calls, metadata=request.metadata or {},
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id, reasoning=request.reasoning,
            store=request.store is not False, temperature=self.temperature, top_p=self.top_p,
            text=text or {"format": {"type": "text"}}, tool_choice=request.tool_choice or "auto",
            tools=request.tools or [], top_logprobs=request.top_logprobs or 0, user=request.user,
            safety_identifier=request.safety_identifier)


class OpenAIServingResponses(OpenAIServing):
    """``reasoner``: the engine's reasoning parser (the chat endpoint's), or None; ``chat_template``
    and ``chat_template_content_format``: the server's --chat-template and
    --chat-template-content-format, as the chat endpoint renders with them; ``tool_parser_cls`` and
    ``enable_auto_tools``: the chat endpoint's (--tool-call-parser, --enable-auto-tool-choice)."""

    def __init__(self, engine: Any, served_model_names: list[str], *, reasoner: Any = None,
                 chat_template: str | None = None, chat_template_content_format: str = "auto",
                 tool_parser_cls: type | None = None, enable_auto_tools: bool = False) -> None:
        super().__init__(engine, served_model_names)
        self.reasoner = reasoner
        self.tool_parser_cls = tool_parser_cls
        self.enable_auto_tools = enable_auto_tools and tool_parser_cls is not None
        self.chat_template = chat_template
        self.chat_template_content_format = chat_template_content_format
        self.store = ResponseStore()
        self.background = BackgroundResponses(self.store, lambda request_id: self.engine.abort(request_id))

    def new_response_id(self) -> str:
        return new_id("resp")  # the engine's request id is the response's id

    # -- routes ----------------------------------------------------------------------------------
    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        self.check_generative(model, "/v1/responses")
        try:
            check_request(request, self.engine.input_processor.max_logprobs)
        except RequestFieldError as exc:
            raise field_error(exc) from None
        previous = None
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise APIError(400, f"Previous response with id {request.previous_response_id!r} not found (the "
                               f"server keeps the last {MAX_STORED_RESPONSES} responses created with store true, "
                               "until it restarts)", "BadRequestError", param="previous_response_id",
                               code="previous_response_not_found")
            if previous.turns is None:
                raise bad_param("previous_response_id", f"response {request.previous_response_id!r} is "
                                f"{previous.body['status']}: it has no reply to continue from")
        if request.background:
            self.background.check_room()
        # Every string checked first, so that a bad one is named where the client wrote it.
        await self.off_loop(check_unicode, request)
        try:
            conversation = conversation_of(request, (previous.turns or []) if previous is not None else [])
            chat_request = chat_request_of(request, conversation)
        except RequestFieldError as exc:
            raise field_error(exc) from None
        try:
            return await self._create(request, raw_request, model, conversation, chat_request)
        except APIError as exc:
            raise in_responses_words(exc, conversation) from None

    def retrieve(self, response_id: str, *, stream: str | None, starting_after: str | None,
                 include: list[str], include_obfuscation: str | None) -> Response:
        """GET /v1/responses/{id}: the stored response; with stream=true a background stream's
        events after ``starting_after``. Query values as sent, checked here."""
        if include:  # would re-render a finished response
            raise bad_param("include", "not supported when retrieving a response (a stored response is returned "
                            "as it was served)", code="unsupported")
        streamed = query_bool("stream", stream)
        if query_bool("include_obfuscation", include_obfuscation):
            raise bad_param("include_obfuscation", "stream obfuscation is never applied here", code="unsupported")
        after = query_int("starting_after", starting_after, -1)
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if not streamed:
            if starting_after is not None:
                raise bad_param("starting_after", "only with stream=true (a sequence number of the stream's events)")
            return JSONResponse(stored.body)
        run = stored.run
        if run is None or run.events is None:
            raise bad_param("stream", "only a response created with background true and stream true can be "
                            "streamed again; retrieve this one without stream", code="unsupported")
        if starting_after is not None and not 0 <= after < len(run.events):
            raise bad_param("starting_after", f"the sequence number of an event sent so far: 0 to "
                            f"{len(run.events) - 1}, got {after}")
        return StreamingResponse(run.follow(after), media_type="text/event-stream")

    async def cancel(self, response_id: str) -> dict[str, Any]:
        return await self.background.cancel(response_id)

    async def delete(self, response_id: str) -> DeletedResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        await self.background.stop(response_id, stored)  # a running background response: cancelled first
        self.store.delete(response_id)
        return DeletedResponse(id=response_id)

    def input_items(self, response_id: str, *, limit: str | None, order: str | None, after: str | None,
                    include: list[str]) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return list_input_items(stored.input_items, limit=limit, order=order, after=after, include=include)

    # -- generation --------------------------------------------------------------------------------
    async def _create(self, request: ResponsesRequest, raw_request: Request, model: str,
                      conversation: Conversation, chat_request: Any) -> Response:
        self.check_common(chat_request)
        try:
            tool_choice = resolve_tool_choice(chat_request, auto_enabled=self.enable_auto_tools)
        except RequestFieldError as exc:
            raise field_error(exc) from None
        adjust_request(self.tool_parser_cls, chat_request, tool_choice.kind, self.reasoner)
        if tool_choice.forced:
            structured_outputs = await self.off_loop(tool_structured_outputs, chat_request, tool_choice)
        else:
            structured_outputs = await self.structured_outputs(chat_request)
        prompt = await self.off_loop(render_prompt, self.engine.input_processor,
                                     template_request(chat_request, self, tool_choice.kind), self.chat_template,
                                     self.chat_template_content_format, default_param="messages")
        prompt_ids = prompt["prompt_token_ids"]
        top_logprobs = (request.top_logprobs or 0) if wants_logprobs(request) else None
        # A background response is read output by output, so that its status follows the engine's.
        params = self.sampling_params(chat_request, max_tokens=request.max_output_tokens, logprobs=top_logprobs,
                                      stream=bool(request.stream or request.background), longest_prompt=len(prompt_ids),
                                      structured_outputs=structured_outputs)
        response_id = self.new_response_id()
        streams = await self.submit(response_id, [prompt], params, request.priority,
                                    self.lora_request_of(request.model), request=chat_request)
        pending = Pending(request, response_id, model, int(time.time()), conversation, len(prompt_ids),
                          params.temperature, params.top_p)
        tools = ReplyParsers(chat_request, tool_choice, prompt_ids, self.engine.tokenizer,
                             tool_parser_cls=self.tool_parser_cls).stream() if tool_choice.kind != "none" else None
        builder = OutputBuilder(prompt_ids, reasoner=self.reasoner, tokenizer=self.engine.tokenizer,
                                top_logprobs=top_logprobs, as_token_ids=chat_request.return_tokens_as_token_ids,
                                tools=tools)
        if request.background:
            return self._start_background(pending, builder, streams[0])
        if request.stream:
            return StreamingResponse(self._stream(pending, builder, streams[0]), media_type="text/event-stream")
        final = await cancel_on_disconnect(raw_request, collect_final(streams[0]))
        if final is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        pending.cached_tokens = final.num_cached_tokens or 0
        completion = final.outputs[0]
        builder.feed(completion)
        incomplete = completion.finish_reason == "length"
        builder.close(incomplete)
        body = pending.response("incomplete" if incomplete else "completed", builder).model_dump(mode="json")
        self._keep(pending, builder, body)
        return JSONResponse(body)

    def _keep(self, pending: Pending, builder: OutputBuilder, body: dict[str, Any]) -> None:
        """Store a finished response when the request asks for it."""
        if pending.request.store is not False:
            self.store.put(pending.response_id, StoredResponse(body, self._turns(pending, builder),
                                                               input_items_of(pending.request)))

    @staticmethod
    def _turns(pending: Pending, builder: OutputBuilder) -> list[dict[str, Any]]:
        return [*pending.conversation.turns, builder.turn()]

    def _start_background(self, pending: Pending, builder: OutputBuilder,
                          stream: AsyncGenerator[RequestOutput, None]) -> Response:
        body = pending.response("queued").model_dump(mode="json")
        streamed = bool(pending.request.stream)
        entry = StoredResponse(body, None, input_items_of(pending.request), BackgroundRun(streamed))
        self.background.start(pending.response_id, entry, self._events(pending, builder, stream, queued=True),
                              lambda: self._turns(pending, builder))
        if streamed:  # the events as the task publishes them: this client may go, the task goes on
            return StreamingResponse(entry.run.follow(), media_type="text/event-stream")
        return JSONResponse(body)

    async def _stream(self, pending: Pending, builder: OutputBuilder,
                      stream: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[str]:
        events = EventSequence()
        async for event in self._events(pending, builder, stream):
            if event["type"] in FINISHED:
                self._keep(pending, builder, event["response"])  # stored before the client hears of it
            yield events.sse(event)

    async def _events(self, pending: Pending, builder: OutputBuilder, stream: AsyncGenerator[RequestOutput, None],
                      queued: bool = False) -> AsyncIterator[Event]:
        """The response's stream events, unnumbered. ``queued`` (a background response): created in
        status queued, in progress from the engine's first output."""
        started = pending.response("in_progress").model_dump(mode="json")
        yield {"type": "response.created", "response": {**started, "status": "queued"} if queued else started}
        if not queued:
            yield {"type": "response.in_progress", "response": started}
        incomplete = False
        try:
            async for _, output in merge_streams([stream]):
                if queued:
                    yield {"type": "response.in_progress", "response": started}
                    queued = False
                pending.cached_tokens = output.num_cached_tokens or pending.cached_tokens
                for completion in output.outputs:
                    incomplete = incomplete or completion.finish_reason == "length"
                    for event in builder.feed(completion):
                        yield event
        except (EngineDeadError, ValueError) as exc:
            error = in_responses_words(stream_error(exc, self.log_error_stack), pending.conversation)
            yield {"type": "error", "code": error.code, "message": error.message, "param": error.param}
            code = "server_error" if isinstance(exc, EngineDeadError) else "invalid_prompt"
            failed = pending.response("failed", error=ResponseError(code=code, message=error.message))
            yield {"type": "response.failed", "response": failed.model_dump(mode="json")}
            return
        for event in builder.close(incomplete):
            yield event
        status = "incomplete" if incomplete else "completed"
        yield {"type": f"response.{status}", "response": pending.response(status, builder).model_dump(mode="json")}
