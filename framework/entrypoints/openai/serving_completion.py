"""POST /v1/completions: text or token-id prompts, streamed (SSE) or whole."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparrow.engine.exceptions import EngineDeadError
from sparrow.engine.prompt_embeds import (
    check_prompt_embeds,
    decode_prompt_embeds,
    engine_prompt_length,
    refuse_disabled,
)
from sparrow.entrypoints.openai.error_handlers import stream_error
from sparrow.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    PromptLogprob,
    PromptTokensDetails,
    UsageInfo,
)
from sparrow.entrypoints.openai.request_checks import check_unicode, not_supported
from sparrow.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    clamp_logprob,
    collect_finals,
    field_error,
    token_label,
    usage,
)
from sparrow.entrypoints.openai.streams import cancel_on_disconnect, merge_streams
from sparrow.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs

logger = logging.getLogger(__name__)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """OpenAI's prompt forms as engine prompts: one per choice group."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "BadRequestError", param="prompt", code="invalid_value")
    if all(isinstance(item, int) for item in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    return [{"prompt_token_ids": list(item)} for item in prompt]


def tokenize_prompts(input_processor: Any, request: CompletionRequest) -> list[dict[str, Any]]:
    """Every prompt of the request as ``{"prompt": text, "prompt_token_ids": [...]}`` (no text for
    token prompts), tokenized with the request's ``add_special_tokens`` and cut to its
    ``truncate_prompt_tokens``, with its ``cache_salt``. Blocking: the endpoint runs it in a
    worker thread."""
    check_unicode(request)
    prompts = embeds_prompts(input_processor, request)  # vLLM's order: the embeddings first
    text_prompts = request.prompt
    if text_prompts is None or (prompts and text_prompts in ("", [])):  # the SDK makes clients send a prompt
        if not prompts:
            raise APIError(400, "prompt is required (or prompt_embeds, with --enable-prompt-embeds)",
                           "BadRequestError", param="prompt", code="invalid_value")
        text_prompts = []
    for prompt in completion_prompts(text_prompts) if text_prompts != [] else []:
        if isinstance(prompt, str):
            all_ids = input_processor.tokenize(prompt, add_special_tokens=request.add_special_tokens)
            token_ids = input_processor.truncate(all_ids, request.truncate_prompt_tokens)
            if len(token_ids) < len(all_ids):
                prompt = input_processor.tokenizer.decode(token_ids)  # echo shows what the model saw
            prompts.append({"prompt": prompt, "prompt_token_ids": token_ids})
        else:
            prompts.append({"prompt_token_ids": input_processor.truncate(prompt["prompt_token_ids"],
                                                                         request.truncate_prompt_tokens)})
    if request.cache_salt is not None:
        for prompt in prompts:
            prompt["cache_salt"] = request.cache_salt
    return prompts


def embeds_prompts(input_processor: Any, request: CompletionRequest) -> list[dict[str, Any]]:
    """vLLM's ``prompt_embeds``: one base64 ``torch.save``'d tensor or a list of them, each a
    prompt of its own, checked against the model and cut to ``truncate_prompt_tokens``."""
    encoded = request.prompt_embeds
    if encoded is None:
        return []
    label = "prompt_embeds"
    if input_processor.prompt_embeds_hidden_size is None:
        raise refuse_disabled(label)
    items = [encoded] if isinstance(encoded, str) else list(encoded)
    if not items:
        raise APIError(400, "prompt_embeds must not be empty", "BadRequestError", param="prompt_embeds",
                       code="invalid_value")
    prompts = []
    for position, item in enumerate(items):
        where = position if not isinstance(encoded, str) else None
        name = label if where is None else f"prompt_embeds[{where}]"
        embeds = check_prompt_embeds(name, decode_prompt_embeds(item, where), input_processor.prompt_embeds_hidden_size)
        keep = len(input_processor.truncate(list(range(embeds.shape[0])), request.truncate_prompt_tokens))
        prompt: dict[str, Any] = {"prompt_embeds": embeds[embeds.shape[0] - keep:]}
        prompts.append(prompt)
    return prompts


class CompletionLogprobsBuilder:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset) for one
    choice, built incrementally so streamed chunks continue the offsets of earlier ones.

    ``as_token_ids`` labels tokens ``token_id:N``; text offsets still count the decoded text."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids
        self.offset = 0

    def token_text(self, token_id: int, decoded: str | None) -> str:
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""  # skip_tokenizer_init

    def label(self, token_id: int, decoded: str | None) -> str:
        if self.as_token_ids:
            return token_label(token_id, "", True)
        return self.token_text(token_id, decoded)

    def build(self, token_ids: list[int], logprobs: SampleLogprobs,
              out: CompletionLogProbs | None = None) -> CompletionLogProbs:
        """Append ``token_ids`` and their logprobs to ``out`` (a new one by default). A None
        position (the first prompt token, which has no context) gets None entries."""
        out = out if out is not None else CompletionLogProbs()
        for token_id, position in zip(token_ids, logprobs):
            if position is None:
                text = self.token_text(token_id, None)
                out.tokens.append(token_label(token_id, text, self.as_token_ids))
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                out.text_offset.append(self.offset)
                self.offset += len(text)
                continue
            chosen = position.get(token_id)
            text = self.token_text(token_id, chosen.decoded_token if chosen else None)
            out.tokens.append(token_label(token_id, text, self.as_token_ids))
            out.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            # Keyed by text, two tokens can share a key (partial UTF-8 bytes both decode to
            # U+FFFD): the more likely keeps it, and the chosen token's entry is always there.
            top: dict[str, float] = {}
            for other_id, entry in sorted(position.items(), key=lambda item: item[1].rank or 0):
                top.setdefault(self.label(other_id, entry.decoded_token), clamp_logprob(entry.logprob))
            if chosen is not None:
                top[self.label(token_id, chosen.decoded_token)] = clamp_logprob(chosen.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def prompt_logprobs_json(logprobs: PromptLogprobs | None) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token None (the first) or token id ->
    Logprob, the prompt's token first, then the top-k; -inf as vLLM reports it."""
    return [None if position is None else
            {str(token_id): PromptLogprob(logprob=clamp_logprob(entry.logprob), rank=entry.rank,
                                          decoded_token=entry.decoded_token)
             for token_id, entry in position.items()}
            for position in logprobs or []]


class Echo:
    """How a request's choices are shaped by ``echo``: the prompt in front of each choice's text
    (and its logprobs in front of the generated tokens' when logprobs were asked), and with
    ``max_tokens=0`` the one generated token dropped; and what else each choice carries of its
    prompt: its logprobs (vLLM's ``prompt_logprobs``) and, with its generated tokens, its token
    ids (vLLM's ``return_token_ids``), both streamed in the choice's first chunk."""

    def __init__(self, echo: bool, echo_only: bool, with_logprobs: bool, prompt_logprobs: bool,
                 token_ids: bool = False) -> None:
        self.echo, self.echo_only, self.with_logprobs = echo, echo_only, with_logprobs
        self.prompt_logprobs, self.token_ids = prompt_logprobs, token_ids

    def prompt_logprobs_of(self, output: RequestOutput) -> list[dict[str, PromptLogprob] | None] | None:
        return prompt_logprobs_json(output.prompt_logprobs) if self.prompt_logprobs else None

    def add_prompt(self, choice: CompletionResponseChoice, output: RequestOutput) -> None:
        """What a choice's first (or only) chunk carries of its prompt."""
        choice.prompt_logprobs = self.prompt_logprobs_of(output)
        if self.token_ids:
            choice.prompt_token_ids = list(output.prompt_token_ids or [])

    def must_send(self, completion: CompletionOutput, first: bool) -> bool:
        """Whether a streamed output with no text yet (tokens that end mid-character, or any
        token without a tokenizer) still goes out now: it finishes the choice, or carries what
        only it carries (logprobs, token ids, the prompt's part of the choice's first chunk)."""
        return bool(completion.finish_reason is not None or completion.logprobs
                    or (self.token_ids and completion.token_ids)
                    or (first and (self.echo or self.prompt_logprobs or self.token_ids)))

    def generated(self, completion: CompletionOutput) -> CompletionOutput:
        if not self.echo_only:
            return completion
        return dataclasses.replace(completion, text="", token_ids=[], cumulative_logprob=None,
                                   logprobs=[] if completion.logprobs is not None else None)

    def prefix(self, output: RequestOutput, builder: CompletionLogprobsBuilder,
               tokenizer: Any) -> tuple[str, CompletionLogProbs | None]:
        if not self.echo:
            return "", None
        token_ids = list(output.prompt_token_ids or [])
        text = output.prompt if output.prompt is not None else tokenizer.decode(token_ids)
        logprobs = None
        if self.with_logprobs and output.prompt_logprobs is not None:
            logprobs = builder.build(token_ids, output.prompt_logprobs)
        return text, logprobs


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(request.model)
        self.check_generative(model, "/v1/completions")
        self.check_common(request)
        if request.suffix:
            raise field_error(not_supported("suffix", "suffix (fill-in-the-middle)"))
        echo = bool(request.echo)
        if request.max_tokens == 0 and not echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo)", "BadRequestError",
                           param="max_tokens", code="invalid_value")
        if request.best_of is not None and request.best_of != request.n:
            raise field_error(not_supported("best_of", "best_of other than n (returning the best of several samples)"))
        if request.prompt_embeds is not None:
            for name, value in (("echo", echo), ("use_beam_search", request.use_beam_search)):
                if value:
                    raise APIError(400, f"{name} is not supported with prompt_embeds (a prompt given as embeddings "
                                   "has no tokens to echo or to search from)", "BadRequestError", param=name,
                                   code="invalid_value")
        structured_outputs = await self.structured_outputs(request)
        prompts = await self.off_loop(tokenize_prompts, self.engine.input_processor, request, default_param="prompt")
        # echo with max_tokens=0 scores the prompt: one token is generated and dropped, as vLLM does.
        echo_only = echo and request.max_tokens == 0
        prompt_logprobs = request.prompt_logprobs
        if echo and request.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = request.logprobs  # echoed prompt tokens carry their logprobs too
        request_id = self.new_request_id(raw_request, request.request_id)
        if request.use_beam_search:  # check_common refused echo, prompt_logprobs and structured outputs
            streams = await self.beam_searches(request_id, prompts, request, request.max_tokens, request.logprobs)
        else:
            params = self.sampling_params(request, max_tokens=1 if echo_only else request.max_tokens,
                                          logprobs=request.logprobs, stream=bool(request.stream),
                                          longest_prompt=max(map(engine_prompt_length, prompts)),
                                          prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs)
            streams = await self.submit(request_id, prompts, self.per_prompt(params, prompts, request.max_tokens),
                                        request.priority, self.lora_request_of(request.model), request=request,
                                        raw_request=raw_request)
        n = request.n
        shape = Echo(echo, echo_only, request.logprobs is not None, request.prompt_logprobs is not None,
                     request.return_token_ids)
        if request.stream:
            options = request.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = bool(include_usage and options.continuous_usage_stats)
            return StreamingResponse(self._stream(request_id, model, n, streams, include_usage, shape,
                                                  request.return_tokens_as_token_ids, continuous),
                                     media_type="text/event-stream")
        finals = await cancel_on_disconnect(raw_request, collect_finals(streams))
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        response = self._response(request_id, model, n, finals, shape, request.return_tokens_as_token_ids)
        return JSONResponse(response.model_dump(mode="json"))

    def _response(self, request_id: str, model: str, n: int, finals: list[RequestOutput],
                  shape: Echo, as_token_ids: bool) -> CompletionResponse:
        choices, totals = [], UsageInfo()
        for prompt_index, final in enumerate(finals):
            totals.prompt_tokens += final.prompt_length
            for completion in final.outputs:
                completion = shape.generated(completion)
                totals.completion_tokens += len(completion.token_ids)
                builder = CompletionLogprobsBuilder(self.engine.tokenizer, as_token_ids)
                choice = self._choice(prompt_index * n + completion.index, completion, builder,
                                      shape.prefix(final, builder, self.engine.tokenizer), shape.token_ids)
                shape.add_prompt(choice, final)
                choices.append(choice)
        totals.total_tokens = totals.prompt_tokens + totals.completion_tokens
        cached = self.cached(finals)
        if cached is not None:
            totals.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=totals)

    @staticmethod
    def _choice(index: int, completion: CompletionOutput, builder: CompletionLogprobsBuilder,
                prefix: tuple[str, CompletionLogProbs | None] = ("", None),
                token_ids: bool = False) -> CompletionResponseChoice:
        """One choice; ``prefix`` is the echoed prompt's text and logprobs, when echoing;
        ``token_ids``: with the generated token ids (return_token_ids)."""
        text, logprobs = prefix
        if completion.logprobs is not None:
            logprobs = builder.build(completion.token_ids, completion.logprobs, logprobs)
        return CompletionResponseChoice(index=index, text=text + completion.text, logprobs=logprobs,
                                        finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                        token_ids=list(completion.token_ids) if token_ids else None)

    async def _stream(self, request_id: str, model: str, n: int, streams: list, include_usage: bool,
                      shape: Echo, as_token_ids: bool, continuous_usage: bool) -> AsyncIterator[str]:
        builders: dict[int, CompletionLogprobsBuilder] = {}
        prompt_tokens: dict[int, int] = {}
        latest: dict[int, RequestOutput] = {}  # each prompt's newest output (its cached tokens)
        completion_tokens = 0
        try:
            async for prompt_index, output in merge_streams(streams):
                prompt_tokens[prompt_index] = output.prompt_length
                latest[prompt_index] = output
                choices = []
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    completion = shape.generated(completion)
                    completion_tokens += len(completion.token_ids)
                    first = index not in builders
                    # Tokens that end mid-character carry no text yet: their text goes with the next chunk.
                    if not completion.text and not shape.must_send(completion, first):
                        continue
                    builder = builders.setdefault(index, CompletionLogprobsBuilder(self.engine.tokenizer, as_token_ids))
                    prefix = shape.prefix(output, builder, self.engine.tokenizer) if first else ("", None)
                    choice = self._choice(index, completion, builder, prefix, shape.token_ids)
                    if first:
                        shape.add_prompt(choice, output)
                    choices.append(choice)
                if choices:
                    # continuous_usage_stats: the usage so far (of the prompts seen so far) in every chunk.
                    so_far = (usage(sum(prompt_tokens.values()), completion_tokens, self.cached(list(latest.values())))
                              if continuous_usage else None)
                    chunk = CompletionStreamResponse(id=request_id, model=model, choices=choices, usage=so_far)
                    yield f"data: {chunk.model_dump_json()}\n\n"
            if include_usage:
                chunk = CompletionStreamResponse(id=request_id, model=model, choices=[],
                                                 usage=usage(sum(prompt_tokens.values()), completion_tokens,
                                                             self.cached(list(latest.values()))))
                yield f"data: {chunk.model_dump_json()}\n\n"
        except (EngineDeadError, ValueError) as exc:  # after the stream started
            yield f"data: {json.dumps(stream_error(exc, self.log_error_stack).body())}\n\n"
        yield "data: [DONE]\n\n"
