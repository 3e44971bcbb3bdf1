"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparrow.engine.exceptions import EngineDeadError
from sparrow.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTopLogprob,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from sparrow.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    bad_request,
    cancel_on_disconnect,
    clamp_logprob,
    engine_dead,
    merge_streams,
)
from sparrow.outputs import CompletionOutput, RequestOutput, SampleLogprobs

logger = logging.getLogger(__name__)


def message_text(position: int, content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{position}].content: only text parts are supported, got {part.get('type')!r}",
                           "BadRequestError", param="messages", code="unsupported")
        texts.append(part["text"])
    return "\n".join(texts)


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        self.check_common(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "BadRequestError",
                           param="top_logprobs", code="invalid_value")
        prompt = self._render(request)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = self.sampling_params(request, max_tokens=max_tokens, logprobs=logprobs, stream=bool(request.stream))
        request_id = self.new_request_id()
        streams = await self.submit(request_id, [prompt], params, request.priority)
        top_k = request.top_logprobs or 0
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(self._stream(request_id, model, request.n, streams[0], include_usage, top_k),
                                     media_type="text/event-stream")
        final = await cancel_on_disconnect(raw_request, self._collect(streams[0]))
        if final is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._response(request_id, model, final, top_k).model_dump(mode="json"))

    def _render(self, request: ChatCompletionRequest) -> dict[str, Any]:
        messages = [{"role": message.role, "content": message_text(position, message.content)}
                    for position, message in enumerate(request.messages)]
        try:
            text = self.engine.input_processor.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt, **(request.chat_template_kwargs or {}))
        except ValueError as exc:
            raise bad_request(exc, default_param="messages") from None
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
            raise APIError(400, f"messages: the chat template failed: {exc}", "BadRequestError",
                           param="messages", code="invalid_value") from None
        # The template wrote every special token the model expects: add none when tokenizing.
        token_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids}

    @staticmethod
    async def _collect(stream: Any) -> RequestOutput:
        final = None
        try:
            async for _, output in merge_streams([stream]):
                final = output
        except EngineDeadError as exc:
            raise engine_dead(exc) from None
        except ValueError as exc:
            raise bad_request(exc) from None
        assert final is not None
        return final

    def _logprobs(self, token_ids: list[int], logprobs: SampleLogprobs | None, top_k: int) -> ChatCompletionLogProbs | None:
        if logprobs is None:
            return None
        tokenizer = self.engine.tokenizer

        def text_of(token_id: int, decoded: str | None) -> str:
            return decoded if decoded is not None else tokenizer.decode([token_id])

        content = []
        for token_id, position in zip(token_ids, logprobs):
            chosen = position.get(token_id)
            token = text_of(token_id, chosen.decoded_token if chosen else None)
            ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)[:top_k]
            content.append(ChatCompletionLogProb(
                token=token, logprob=clamp_logprob(chosen.logprob) if chosen else -9999.0,
                bytes=list(token.encode("utf-8")),
                top_logprobs=[ChatCompletionTopLogprob(token=(t := text_of(other_id, entry.decoded_token)),
                                                       logprob=clamp_logprob(entry.logprob),
                                                       bytes=list(t.encode("utf-8")))
                              for other_id, entry in ranked],
            ))
        return ChatCompletionLogProbs(content=content)

    def _response(self, request_id: str, model: str, final: RequestOutput, top_k: int) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=completion.index, message=ChatResponseMessage(content=completion.text),
                logprobs=self._logprobs(completion.token_ids, completion.logprobs, top_k),
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
            for completion in final.outputs
        ]
        prompt_tokens = len(final.prompt_token_ids or [])
        completion_tokens = sum(len(completion.token_ids) for completion in final.outputs)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    def _stream_choice(self, completion: CompletionOutput, top_k: int) -> ChatCompletionResponseStreamChoice:
        return ChatCompletionResponseStreamChoice(
            index=completion.index, delta=DeltaMessage(content=completion.text),
            logprobs=self._logprobs(completion.token_ids, completion.logprobs, top_k),
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)

    async def _stream(self, request_id: str, model: str, n: int, stream: Any, include_usage: bool,
                      top_k: int) -> AsyncIterator[str]:
        # OpenAI opens every choice with the assistant's role.
        first = ChatCompletionStreamResponse(id=request_id, model=model, choices=[
            ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            for index in range(n)])
        yield f"data: {first.model_dump_json()}\n\n"
        prompt_tokens = completion_tokens = 0
        try:
            async for _, output in merge_streams([stream]):
                prompt_tokens = len(output.prompt_token_ids or [])
                choices = []
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    if completion.text or completion.logprobs or completion.finish_reason is not None:
                        choices.append(self._stream_choice(completion, top_k))
                if choices:
                    chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=choices)
                    yield f"data: {chunk.model_dump_json()}\n\n"
            if include_usage:
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens)
                chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage)
                yield f"data: {chunk.model_dump_json()}\n\n"
        except EngineDeadError as exc:
            yield f"data: {json.dumps(engine_dead(exc).body())}\n\n"
        except ValueError as exc:
            yield f"data: {json.dumps(bad_request(exc).body())}\n\n"
        yield "data: [DONE]\n\n"
