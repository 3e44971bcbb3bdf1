"""POST /v1/chat/completions: messages rendered with the tokenizer's (or the request's) chat template.

The messages reach the template as transformers' ``apply_chat_template`` expects them: ``name``,
an assistant turn's ``tool_calls`` (their JSON ``arguments`` parsed to objects, as tool-use
templates want them) and ``reasoning_content``, and a tool turn's ``tool_call_id``, with the
request's ``tools``. What tool_choice asks for is resolved in ``tool_calling``; how the generated
text becomes reasoning, answer and tool calls (whole or streamed) is ``chat_output``'s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparrow.engine.exceptions import EngineDeadError
from sparrow.entrypoints.openai.chat_output import ChoiceStream, ReplyParsers
from sparrow.entrypoints.openai.error_handlers import stream_error
from sparrow.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    ToolCall,
)
from sparrow.entrypoints.openai.request_checks import RequestFieldError, check_unicode, content_texts
from sparrow.entrypoints.openai.serving_completion import prompt_logprobs_json
from sparrow.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    collect_final,
    field_error,
    logprob_entry,
    usage,
)
from sparrow.entrypoints.openai.streams import cancel_on_disconnect, merge_streams
from sparrow.entrypoints.openai.tool_calling import resolve_tool_choice, tool_structured_outputs
from sparrow.entrypoints.openai.tool_parsers.base import adjust_request
from sparrow.outputs import CompletionOutput, RequestOutput, SampleLogprobs

logger = logging.getLogger(__name__)


def message_text(position: int, content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(content_texts(f"messages[{position}].content", content))


def _template_tool_call(where: str, call: ToolCall) -> dict[str, Any]:
    """An earlier turn's tool call as templates take it, its arguments parsed to an object (as
    vLLM does; "" is {}). ``where`` is the call's path, ``messages[i].tool_calls[j]``."""
    arguments = call.function.arguments
    field = f"{where}.function.arguments"
    try:
        parsed = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError) as exc:
        raise RequestFieldError(f"{field}: not valid JSON ({exc}); the arguments are a JSON object as a string",
                                field) from None
    if not isinstance(parsed, dict):
        raise RequestFieldError(f"{field}: the arguments are a JSON object as a string, got a JSON "
                                f"{type(parsed).__name__}", field)
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": parsed}}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them."""
    rendered = []
    for position, message in enumerate(messages):
        content: Any = message.content
        if isinstance(content, list):  # text parts only; the renderer joins them or keeps them as parts
            content = [{"type": "text", "text": text}
                       for text in content_texts(f"messages[{position}].content", content)]
        entry: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [_template_tool_call(f"messages[{position}].tool_calls[{index}]", call)
                                   for index, call in enumerate(message.tool_calls)]
            if message.content is None:
                entry["content"] = None  # a turn that only called tools, as templates expect it
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        rendered.append(entry)
    return rendered


def check_default_template_kwargs(engine: Any, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """--default-chat-template-kwargs checked against the served tokenizer; a ValueError naming the
    flag for a variable that is the renderer's own argument, or without a tokenizer."""
    if not kwargs:
        return None
    from sparrow.engine.chat_render import reserved_template_names
    from sparrow.engine.text_checks import check_text

    if engine.tokenizer is None:
        raise ValueError("--default-chat-template-kwargs: this server has no tokenizer (skip_tokenizer_init), so it "
                         "renders no chat template")
    check_text("--default-chat-template-kwargs", kwargs)
    reserved = sorted(set(kwargs) & reserved_template_names(engine.tokenizer))
    if reserved:
        raise ValueError(f"--default-chat-template-kwargs: {', '.join(map(repr, reserved))} cannot be set there; they "
                         "are the renderer's own arguments (requests set them by the fields of those names)")
    return dict(kwargs)


def template_request(request: Any, handler: Any, tool_choice_kind: str | None = None) -> Any:
    """The request as the chat template should see it under the server's flags: the handler's
    --default-chat-template-kwargs and the request's reasoning_effort under its own
    chat_template_kwargs (key by key), and without its tools when
    --exclude-tools-when-tool-choice-none and tool_choice is "none"."""
    update: dict[str, Any] = {}
    defaults = dict(handler.default_chat_template_kwargs or {})
    effort = getattr(request, "reasoning_effort", None)
    if effort is not None:  # OpenAI's field, for templates that read it (vLLM passes it the same way)
        defaults["reasoning_effort"] = effort
    own = request.chat_template_kwargs
    if defaults and (own is None or isinstance(own, dict)):  # anything else: the renderer names it
        update["chat_template_kwargs"] = {**defaults, **(own or {})}
    if tool_choice_kind == "none" and handler.exclude_tools_when_tool_choice_none and getattr(request, "tools", None):
        update["tools"] = None
    return request.model_copy(update=update) if update else request


def render_prompt(input_processor: Any, request: ChatCompletionRequest,
                  default_template: str | None = None, content_format: str = "auto") -> dict[str, Any]:
    """The request's prompt, ``{"prompt": text, "prompt_token_ids": [...]}``: every string checked,
    the messages rendered (with the request's chat_template, else ``default_template``, the
    server's --chat-template, else the tokenizer's) and tokenized, cut to
    ``truncate_prompt_tokens``. ``content_format``: the --chat-template-content-format (a list of
    text parts reaches the template as parts or joined by newlines; ``sparrow.engine.chat_content``).
    Blocking: the endpoint runs it in a worker thread."""
    check_unicode(request)
    messages = template_messages(request.messages)
    try:
        text = input_processor.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template if request.chat_template is not None else default_template,
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None,
            chat_template_kwargs=request.chat_template_kwargs,
            content_format=content_format,
            documents=getattr(request, "documents", None),
        )
    except ValueError:
        raise
    except jinja2.TemplateSyntaxError as exc:
        raise RequestFieldError(f"chat_template: not a valid Jinja template: {exc}", "chat_template") from None
    except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
        raise RequestFieldError(f"messages: the chat template failed: {exc}", "messages") from None
    # By default no special tokens are added: the template wrote every one the model expects.
    all_ids = input_processor.tokenize(text, add_special_tokens=request.add_special_tokens, field="messages")
    if not all_ids:
        # Name what made the prompt empty: the request's template, or else the messages.
        field = "chat_template" if request.chat_template is not None else "messages"
        raise RequestFieldError(f"{field}: the chat template rendered an empty prompt for these messages", field)
    token_ids = input_processor.truncate(all_ids, request.truncate_prompt_tokens)
    if len(token_ids) < len(all_ids):
        text = input_processor.tokenizer.decode(token_ids)
    if request.cache_salt is not None:
        return {"prompt": text, "prompt_token_ids": token_ids, "cache_salt": request.cache_salt}
    return {"prompt": text, "prompt_token_ids": token_ids}


@dataclass(slots=True)
class Reply:
    """How a request's reply is shaped: its role, the echoed text in front of it, its logprob
    entries, the usage its stream carries, and with ``return_token_ids`` (vLLM's) the prompt's
    token ids (``prompt_token_ids``; streamed, in the first chunk) and each choice's generated
    ones (``token_ids``)."""

    role: str
    echo: str  # the last message's text when echo is asked and that message is the reply's role
    top_logprobs: int
    as_token_ids: bool
    include_usage: bool
    continuous_usage: bool
    prompt_tokens: int
    prompt_token_ids: list[int] | None = None  # the rendered prompt's, with return_token_ids

    @property
    def token_ids(self) -> bool:
        return self.prompt_token_ids is not None

    @classmethod
    def of(cls, request: ChatCompletionRequest, prompt_tokens: int, response_role: str = "assistant",
           prompt_token_ids: list[int] | None = None) -> Reply:
        """``prompt_token_ids``: the rendered prompt's (kept with ``return_token_ids``)."""
        last = request.messages[-1]
        # A new turn is the server's --response-role (the assistant's); continuing a message keeps
        # its role (vLLM's rule).
        role = response_role if request.add_generation_prompt else last.role
        echo = message_text(len(request.messages) - 1, last.content) if request.echo and last.role == role else ""
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(include_usage and options.continuous_usage_stats)
        return cls(role, echo, request.top_logprobs or 0, request.return_tokens_as_token_ids, include_usage,
                   continuous, prompt_tokens, list(prompt_token_ids or []) if request.return_token_ids else None)


class OpenAIServingChat(OpenAIServing):
    """``tool_parser_cls``: the --tool-call-parser's class; ``enable_auto_tools``: the server runs
    with --enable-auto-tool-choice (tool_choice "auto" needs both); ``reasoner``: the reasoning
    parser (the engine's reasoning_parser), built with the tokenizer; ``chat_template``: the
    --chat-template (None: the tokenizer's); ``response_role``: the --response-role;
    ``chat_template_content_format``: the --chat-template-content-format."""

    request_id_prefix = "chatcmpl"

    def __init__(self, engine: Any, served_model_names: list[str], *, tool_parser_cls: type | None = None,
                 enable_auto_tools: bool = False, reasoner: Any = None, chat_template: str | None = None,
                 response_role: str = "assistant", chat_template_content_format: str = "auto") -> None:
        super().__init__(engine, served_model_names)
        self.chat_template = chat_template
        self.chat_template_content_format = chat_template_content_format
        self.response_role = response_role
        self.tool_parser_cls = tool_parser_cls
        self.enable_auto_tools = enable_auto_tools and tool_parser_cls is not None
        self.reasoner = reasoner

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        self.check_generative(model, "/v1/chat/completions")
        self.check_common(request)
        self.check_chat_template(request)
        try:
            tool_choice = resolve_tool_choice(request, auto_enabled=self.enable_auto_tools)
        except RequestFieldError as exc:
            raise field_error(exc) from None
        adjust_request(self.tool_parser_cls, request, tool_choice.kind, self.reasoner)
        if request.prompt_logprobs is not None and request.stream:
            raise APIError(400, "prompt_logprobs are not available when stream is true (as in vLLM)", "BadRequestError",
                           param="prompt_logprobs", code="invalid_value")
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "BadRequestError",
                           param="top_logprobs", code="invalid_value")
        limit = self.engine.input_processor.max_logprobs
        if request.top_logprobs is not None and request.top_logprobs > limit:
            raise APIError(400, f"top_logprobs={request.top_logprobs} exceeds the maximum of {limit} (the server's "
                           "max_logprobs)", "BadRequestError", param="top_logprobs", code="invalid_value")
        if tool_choice.forced:
            structured_outputs = await self.off_loop(tool_structured_outputs, request, tool_choice)
        else:
            structured_outputs = await self.structured_outputs(request)
        prompt = await self.off_loop(render_prompt, self.engine.input_processor,
                                     template_request(request, self, tool_choice.kind), self.chat_template,
                                     self.chat_template_content_format, default_param="messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        request_id = self.new_request_id(raw_request, request.request_id)
        if request.use_beam_search:  # check_common refused tools and structured outputs
            streams = await self.beam_searches(request_id, [prompt], request, max_tokens, logprobs)
        else:
            params = self.sampling_params(request, max_tokens=max_tokens, logprobs=logprobs,
                                          stream=bool(request.stream), longest_prompt=len(prompt["prompt_token_ids"]),
                                          prompt_logprobs=request.prompt_logprobs,
                                          structured_outputs=structured_outputs)
            streams = await self.submit(request_id, [prompt], params, request.priority,
                                        self.lora_request_of(request.model), request=request, raw_request=raw_request)
        reply = Reply.of(request, len(prompt["prompt_token_ids"]), self.response_role, prompt["prompt_token_ids"])
        parsers = ReplyParsers(request, tool_choice, prompt["prompt_token_ids"], self.engine.tokenizer,
                               self.reasoner, self.tool_parser_cls)
        if request.stream:
            return StreamingResponse(self._stream(request_id, model, request.n, streams[0], reply, parsers),
                                     media_type="text/event-stream")
        final = await cancel_on_disconnect(raw_request, collect_final(streams[0]))
        if final is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._response(request_id, model, final, reply, parsers).model_dump(mode="json"))

    def _logprobs(self, token_ids: list[int], logprobs: SampleLogprobs | None,
                  reply: Reply) -> ChatCompletionLogProbs | None:
        if logprobs is None:
            return None
        tokenizer = self.engine.tokenizer
        return ChatCompletionLogProbs(content=[
            ChatCompletionLogProb(**logprob_entry(token_id, position, reply.top_logprobs, tokenizer,
                                                  reply.as_token_ids))
            for token_id, position in zip(token_ids, logprobs)])

    def _response(self, request_id: str, model: str, final: RequestOutput, reply: Reply,
                  parsers: ReplyParsers) -> ChatCompletionResponse:
        choices = []
        for completion in final.outputs:
            message, called = parsers.message(reply.role, reply.echo, completion.text)
            choices.append(ChatCompletionResponseChoice(
                index=completion.index, message=message,
                logprobs=self._logprobs(completion.token_ids, completion.logprobs, reply),
                finish_reason=parsers.finish_reason(completion.finish_reason, called),
                stop_reason=completion.stop_reason,
                token_ids=list(completion.token_ids) if reply.token_ids else None))
        completion_tokens = sum(len(completion.token_ids) for completion in final.outputs)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage(final.prompt_length, completion_tokens,
                                                  self.cached([final])),
                                      prompt_token_ids=reply.prompt_token_ids,
                                      prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs)
                                      if final.prompt_logprobs is not None else None)

    def _stream_choice(self, completion: CompletionOutput, reply: Reply,
                       choice: ChoiceStream) -> ChatCompletionResponseStreamChoice | None:
        """The chunk's entry for this choice; None when it has nothing to send yet. New token ids
        (return_token_ids) go out at once, also while the parsers hold back their text."""
        finished = completion.finish_reason is not None
        delta = choice.feed(completion.text, final=finished)
        token_ids = list(completion.token_ids) if reply.token_ids else None
        if delta is None and not (completion.logprobs or finished or token_ids):
            return None
        return ChatCompletionResponseStreamChoice(
            index=completion.index, delta=delta or DeltaMessage(content=""),
            logprobs=self._logprobs(completion.token_ids, completion.logprobs, reply),
            finish_reason=choice.parsers.finish_reason(completion.finish_reason, choice.called),
            stop_reason=completion.stop_reason, token_ids=token_ids)

    async def _stream(self, request_id: str, model: str, n: int, stream: Any, reply: Reply,
                      parsers: ReplyParsers) -> AsyncIterator[str]:
        prompt_tokens, completion_tokens = reply.prompt_tokens, 0
        cached = None  # known with the first output
        so_far = usage(prompt_tokens, 0) if reply.continuous_usage else None
        # OpenAI opens every choice with the role; an echoed message follows in the same delta.
        first = ChatCompletionStreamResponse(id=request_id, model=model, usage=so_far, choices=[
            ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(role=reply.role, content=reply.echo))
            for index in range(n)], prompt_token_ids=reply.prompt_token_ids)
        yield f"data: {first.model_dump_json()}\n\n"
        choice_streams = [parsers.stream() for _ in range(n)]
        try:
            async for _, output in merge_streams([stream]):
                prompt_tokens = output.prompt_length or prompt_tokens
                cached = self.cached([output])
                choices, finishes = [], []
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    choice = self._stream_choice(completion, reply, choice_streams[completion.index])
                    if choice is None:
                        continue
                    choices.append(choice)
                    if choice.finish_reason is not None and choice.delta.tool_calls:
                        # OpenAI ends a call in its own empty-delta chunk; the SDK's
                        # `arguments.done` event is only fired in that order.
                        finishes.append(choice.model_copy(update={"delta": DeltaMessage(), "logprobs": None,
                                                                  "token_ids": None}))
                        choices[-1] = choice.model_copy(update={"finish_reason": None, "stop_reason": None})
                so_far = usage(prompt_tokens, completion_tokens, cached) if reply.continuous_usage else None
                for group in (choices, finishes):
                    if group:
                        chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=group, usage=so_far)
                        yield f"data: {chunk.model_dump_json()}\n\n"
            if reply.include_usage:
                chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=[],
                                                     usage=usage(prompt_tokens, completion_tokens, cached))
                yield f"data: {chunk.model_dump_json()}\n\n"
        except (EngineDeadError, ValueError) as exc:  # after the stream started
            yield f"data: {json.dumps(stream_error(exc, self.log_error_stack).body())}\n\n"
        yield "data: [DONE]\n\n"
