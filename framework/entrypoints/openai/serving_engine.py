"""What the endpoints share: model and field checks, SamplingParams from a request, work off the
event loop, submitting prompts (or beam searches), whole responses, logprob token labels. Errors
in OpenAI's shape: ``api_errors`` (re-exported here). Merging streams and client disconnects:
``sparrow.entrypoints.openai.streams``."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Callable, TypeVar

from sparrow.engine.async_beam_search import async_beam_search
from sparrow.engine.async_llm import AsyncLLM
from sparrow.engine.exceptions import EngineDeadError
from sparrow.engine.generation_defaults import server_max_tokens_cap
from sparrow.engine.prompt_embeds import engine_prompt_length
from sparrow.engine.text_checks import check_text
from sparrow.entrypoints.openai.api_errors import (  # noqa: F401 - re-exported: the endpoints import them from here
    APIError,
    bad_request,
    client_words,
    engine_dead,
    field_error,
    request_param,
)
from sparrow.entrypoints.openai.protocol import PromptTokensDetails, SamplingFields, StreamOptions, UsageInfo
from sparrow.entrypoints.openai.request_checks import RequestFieldError, check_beam_search, check_fields
from sparrow.entrypoints.openai.streams import collect_final, collect_finals  # noqa: F401 - re-exported
from sparrow.entrypoints.openai.structured_outputs import GUIDED_FIELDS, in_request_words, structured_outputs_of
from sparrow.errors import InvalidArgumentError
from sparrow.outputs import Logprob, RequestOutput, SampleLogprobs
from sparrow.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM reports this instead


def clamp_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def token_label(token_id: int, text: str, as_token_id: bool) -> str:
    """A logprob entry's token: its text, or ``token_id:N`` (vLLM's return_tokens_as_token_ids),
    which stays unique where several tokens decode to the same text (partial UTF-8 bytes)."""
    return f"token_id:{token_id}" if as_token_id else text


def logprob_entry(token_id: int, position: dict[int, Logprob], top_k: int, tokenizer: Any,
                  as_token_id: bool) -> dict[str, Any]:
    """One generated token's logprobs in the chat and responses endpoints' shape: the chosen
    token (its text, logprob, UTF-8 bytes) and its ``top_k`` most likely ones, by rank."""

    def scored(other_id: int, entry: Logprob | None) -> dict[str, Any]:
        text = entry.decoded_token if entry is not None and entry.decoded_token is not None \
            else tokenizer.decode([other_id])
        return {"token": token_label(other_id, text, as_token_id),
                "logprob": clamp_logprob(entry.logprob if entry is not None else LOGPROB_FLOOR),
                "bytes": list(text.encode("utf-8"))}

    ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)[:top_k]
    return {**scored(token_id, position.get(token_id)),
            "top_logprobs": [scored(other_id, entry) for other_id, entry in ranked]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
    """``cached_tokens``: the prompt tokens the prefix cache held (None: no prompt_tokens_details)."""
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


def logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON string keys) as SamplingParams takes it."""
    if not value:
        return None
    try:
        return {int(token_id): bias for token_id, bias in value.items()}
    except ValueError:
        raise APIError(400, f"logit_bias keys must be token ids, got {sorted(value)[:5]}", "BadRequestError",
                       param="logit_bias", code="invalid_value") from None


class OpenAIServing:
    """Base of the endpoint handlers: one per endpoint, built once per app."""

    request_id_prefix = "req"
    # Server flags (build_app sets them per handler):
    # --return-tokens-as-token-ids: every request's logprob tokens as 'token_id:N';
    return_tokens_as_token_ids = False
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens in every response.
    enable_prompt_tokens_details = False
    # --enable-force-include-usage: every stream ends with its usage, as if include_usage were asked.
    enable_force_include_usage = False
    # --trust-request-chat-template: a request's own chat_template is rendered (else refused).
    trust_request_chat_template = False
    # --log-error-stack: the stack behind an error event in a stream is logged (error_handlers).
    log_error_stack = False
    # --default-chat-template-kwargs: template variables under every chat request's own.
    default_chat_template_kwargs: dict[str, Any] | None = None
    # --exclude-tools-when-tool-choice-none: tool_choice "none" renders without the tools.
    exclude_tools_when_tool_choice_none = False

    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        # The LoRA adapters served under their own names (serving_models.LoRAModules), or None.
        self.lora_modules: Any = None
        # --enable-log-requests: a request_logger.RequestLogger, or None.
        self.request_logger: Any = None
        # A parameter a request leaves unset takes the model's generation-config default (vLLM's
        # default_sampling_params); a max_new_tokens override caps every request's max_tokens.
        self.default_sampling_params: dict[str, Any] = dict(engine.default_sampling_params)
        self.max_tokens_cap = server_max_tokens_cap(engine.model_config, self.default_sampling_params)

    def cached(self, outputs: list[RequestOutput]) -> int | None:
        """usage's cached_tokens of these outputs (one per prompt), or None when not reported."""
        if not self.enable_prompt_tokens_details:
            return None
        return sum(output.num_cached_tokens or 0 for output in outputs)

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        if self.lora_request_of(model) is not None:
            return model
        try:
            check_text("model", model)
        except ValueError as exc:
            raise bad_request(exc, default_param="model") from None
        served = [*self.served_model_names, *(self.lora_modules.adapters if self.lora_modules is not None else ())]
        raise APIError(404, f"the model {model!r} does not exist; served: {', '.join(served)}",
                       "NotFoundError", param="model", code="model_not_found")

    def check_generative(self, model: str, endpoint: str) -> None:
        """On a pooling model (embeddings, a classifier), the generation endpoints are a 400 saying so
        before any work (the input processor would refuse each prompt too, naming sampling_params)."""
        pooling = self.engine.input_processor.pooling
        if pooling is None:
            return
        from sparrow.entrypoints.openai.serving_embedding import pooling_model_kind

        kind, answers = pooling_model_kind(pooling)
        raise APIError(400, f"the model {model!r} is {kind} (this server runs it as a pooling model): it answers "
                       f"{answers}, not {endpoint}; serve a generative model to generate text", "BadRequestError",
                       param="model", code="unsupported")

    def lora_request_of(self, model: str | None) -> Any:
        """The LoRARequest a request's ``model`` names, or None for the base model."""
        return self.lora_modules.get(model) if self.lora_modules is not None else None

    def check_chat_template(self, request: Any) -> None:
        """A request's own ``chat_template`` runs arbitrary (sandboxed) Jinja on the server's input
        thread: as in vLLM, only with --trust-request-chat-template."""
        if getattr(request, "chat_template", None) is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template: a request's own chat template is refused; start the server with "
                           "--trust-request-chat-template to allow it, or set the server's with --chat-template",
                           "BadRequestError", param="chat_template", code="unsupported")

    def new_request_id(self, raw_request: Any = None, requested: str | None = None) -> str:
        """The endpoint's prefix and vLLM's base id: the X-Request-Id header, else the request's
        ``request_id``, else a random one. A header id that is empty, longer than 256 characters
        or not printable is a 400 naming request_id."""
        header = raw_request.headers.get("x-request-id") if raw_request is not None else None
        if header is not None and not (0 < len(header) <= 256 and header.isprintable()):
            raise APIError(400, "request_id: the X-Request-Id header must be 1-256 printable characters",
                           "BadRequestError", param="request_id", code="invalid_value")
        return f"{self.request_id_prefix}-{header or requested or uuid.uuid4().hex}"

    def check_common(self, request: SamplingFields) -> None:
        """Refuse what no endpoint honours (unknown and not-yet-supported fields, what beam search
        cannot honour) before any work."""
        try:
            check_fields(request)
            check_beam_search(request, self.engine.input_processor.max_logprobs)
        except RequestFieldError as exc:
            raise field_error(exc) from None
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "BadRequestError",
                           param="stream_options", code="invalid_value")
        if self.return_tokens_as_token_ids or self.engine.tokenizer is None:
            # The server's default (a request can only turn it on), or the only way to name
            # tokens without a tokenizer (skip_tokenizer_init).
            request.return_tokens_as_token_ids = True
        if self.engine.tokenizer is None and getattr(request, "echo", False):
            raise APIError(400, "echo needs the prompt's text, and this server has no tokenizer "
                           "(skip_tokenizer_init)", "BadRequestError", param="echo", code="invalid_value")
        if self.enable_force_include_usage and request.stream:
            options = request.stream_options or StreamOptions()
            request.stream_options = options.model_copy(update={"include_usage": True})

    async def off_loop(self, work: Callable[..., T], *args: Any, default_param: str | None = None) -> T:
        """Run ``work`` (tokenizing, templating, checking every string) in a worker thread, so
        that a huge prompt does not stall other requests' streams; its ValueErrors become 400s."""
        try:
            # The engine's one input thread: a fast tokenizer used from two threads at once can
            # fail ("Already borrowed"), and the order of requests is kept.
            return await self.engine.run_input_work(work, *args)
        except RequestFieldError as exc:
            raise field_error(exc) from None
        except ValueError as exc:
            raise bad_request(exc, default_param=default_param) from None

    async def structured_outputs(self, request: SamplingFields) -> StructuredOutputsParams | None:
        """The request's structured outputs, parsed off the event loop (the first parse imports
        xgrammar); a 400 naming the field when they are invalid."""
        if (request.response_format is None or request.response_format.type == "text") and all(
                getattr(request, name) is None for name in ("structured_outputs", *GUIDED_FIELDS)):
            return None
        return await self.off_loop(structured_outputs_of, request)

    def sampling_params(self, request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                        stream: bool, longest_prompt: int, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's SamplingParams: ``max_tokens`` as the request gives it (None: the default),
        ``longest_prompt`` the token count of its longest prompt."""
        defaults = self.default_sampling_params

        def unset_to_default(name: str, neutral: Any) -> Any:
            value = getattr(request, name)
            return defaults.get(name, neutral) if value is None else value

        max_tokens = self.resolve_max_tokens(max_tokens, longest_prompt)
        try:
            return SamplingParams(
                n=request.n,
                temperature=unset_to_default("temperature", 1.0),
                top_p=unset_to_default("top_p", 1.0),
                top_k=unset_to_default("top_k", 0),
                min_p=unset_to_default("min_p", 0.0),
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=unset_to_default("repetition_penalty", 1.0),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logit_bias=logit_bias(request.logit_bias),
                allowed_token_ids=request.allowed_token_ids,
                # A stream sends what is new; a full response needs only the end.
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                structured_outputs=structured_outputs,
                bad_words=request.bad_words,
                extra_args=request.vllm_xargs,
                repetition_detection=request.repetition_detection,
                thinking_token_budget=request.thinking_token_budget,
            )
        except ValueError as exc:
            raise bad_request(exc) from None

    def resolve_max_tokens(self, max_tokens: int | None, longest_prompt: int) -> int | None:
        """A request's max_tokens (None: unset) after the generation config's default and cap;
        None still means all the room the prompt leaves."""
        defaults = self.default_sampling_params
        if max_tokens is None and "max_tokens" in defaults:
            # A default, unlike a requested max_tokens, is cut to the room the prompt leaves (as vLLM's is).
            room = (self.engine.model_config.max_model_len or 0) - longest_prompt
            max_tokens = max(1, min(defaults["max_tokens"], room))
        if self.max_tokens_cap is not None and (max_tokens is None or max_tokens > self.max_tokens_cap):
            max_tokens = self.max_tokens_cap
        return max_tokens

    async def beam_searches(self, request_id: str, prompts: list[dict[str, Any]], request: Any,
                            max_tokens: int | None, logprobs: int | None) -> list[AsyncGenerator[RequestOutput, None]]:
        """``use_beam_search``: one beam search per prompt (vLLM's ``to_beam_search_params``: n beams,
        temperature 0 unless set), as streams of one final output each. Every prompt is checked
        first as an ordinary request would be (its length, ``max_tokens`` under max_model_len,
        ``priority``), so that an invalid one is a 400 before anything runs. ``logprobs``: the top
        logprobs each choice shows (None: none)."""
        temperature = request.temperature if request.temperature is not None else 0.0
        max_tokens = self.resolve_max_tokens(max_tokens, max(engine_prompt_length(prompt) for prompt in prompts))
        check = SamplingParams(max_tokens=max_tokens, temperature=temperature, detokenize=False)
        streams = []
        for index, prompt in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            _, checked = await self.off_loop(functools.partial(
                self.engine.input_processor.process_inputs, sub_id, prompt, check, priority=request.priority),
                default_param="prompt")
            try:
                params = BeamSearchParams(
                    beam_width=request.n, max_tokens=checked.max_tokens, ignore_eos=request.ignore_eos,
                    temperature=temperature, include_stop_str_in_output=request.include_stop_str_in_output,
                    length_penalty=1.0 if request.length_penalty is None else request.length_penalty)
            except ValueError as exc:
                raise bad_request(exc) from None
            self.log_inputs(sub_id, prompt, params, self.lora_request_of(request.model))
            streams.append(self.logged(sub_id, self._beam_search(sub_id, prompt, params, request, logprobs),
                                       RequestOutputKind.FINAL_ONLY))
        return streams

    async def _beam_search(self, request_id: str, prompt: dict[str, Any], params: BeamSearchParams, request: Any,
                           logprobs: int | None) -> AsyncGenerator[RequestOutput, None]:
        """One prompt's beam search (``AsyncLLM.beam_search``'s), its choices shaped as an ordinary
        request's: the text decoded as the request asks (``skip_special_tokens``...), the top
        ``logprobs`` of each token."""
        decode_options = {"skip_special_tokens": request.skip_special_tokens,
                          "spaces_between_special_tokens": request.spaces_between_special_tokens}
        async for output in async_beam_search(self.engine, prompt, request_id, params,
                                              self.lora_request_of(request.model), priority=request.priority,
                                              decode_options=decode_options):
            for completion in output.outputs:
                completion.logprobs = None if logprobs is None or completion.logprobs is None else \
                    top_logprobs(completion.token_ids, completion.logprobs, logprobs)
            yield output

    def log_inputs(self, request_id: str, prompt: Any, params: Any, lora_request: Any) -> None:
        """--enable-log-requests: log what is about to reach the engine."""
        if self.request_logger is not None:
            fields = prompt if isinstance(prompt, dict) else {}
            self.request_logger.log_inputs(request_id, fields.get("prompt"), fields.get("prompt_token_ids"), params,
                                           lora_request)

    def logged(self, request_id: str, stream: AsyncGenerator[RequestOutput, None],
               output_kind: RequestOutputKind) -> AsyncGenerator[RequestOutput, None]:
        """--enable-log-outputs: ``stream``, logging its outputs when the request finishes."""
        logger_ = self.request_logger
        if logger_ is None or not logger_.log_outputs:
            return stream
        return logger_.logged(request_id, stream, output_kind)

    def per_prompt(self, params: SamplingParams, prompts: list[dict[str, Any]],
                   max_tokens: int | None) -> list[SamplingParams]:
        """``params`` for each prompt: a default max_tokens (the request set none) is cut to the
        room each prompt leaves, as vLLM cuts it, rather than to the longest prompt's."""
        if max_tokens is not None or len(prompts) == 1:
            return [params] * len(prompts)
        limits = [self.resolve_max_tokens(None, engine_prompt_length(prompt)) for prompt in prompts]
        return [params if limit == params.max_tokens else params.clone(max_tokens=limit) for limit in limits]

    async def submit(self, request_id: str, prompts: list[Any], params: SamplingParams | list[SamplingParams],
                     priority: int, lora_request: Any = None, request: Any = None, raw_request: Any = None
                     ) -> list[AsyncGenerator[RequestOutput, None]]:
        """Validate and submit every prompt before any response is sent, so that an invalid one
        is a 400 and costs the others nothing; one stream of outputs per prompt. ``params``: for
        all prompts, or one per prompt. ``request``: the API request, whose grammar field an
        engine-side grammar failure then names; ``raw_request``: its HTTP request, whose
        X-data-parallel-rank header (vLLM's) picks the data-parallel engine."""
        rank = raw_request.headers.get("x-data-parallel-rank") if raw_request is not None else None
        if rank is not None and not rank.strip().isdigit():
            raise APIError(400, f"data_parallel_rank: the X-data-parallel-rank header must be an engine index, got "
                           f"{rank!r}", "BadRequestError", param="data_parallel_rank", code="invalid_value")
        engine = self.engine
        submitted: list[str] = []
        streams = []
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        try:
            for index, (prompt, prompt_params) in enumerate(zip(prompts, params_list)):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                self.log_inputs(sub_id, prompt, prompt_params, lora_request)
                collector = await engine.add_request(sub_id, prompt, prompt_params, priority=priority,
                                                     lora_request=lora_request,
                                                     data_parallel_rank=None if rank is None else int(rank))
                submitted.append(sub_id)
                stream = engine.stream_outputs(sub_id, collector)
                if prompt_params.structured_outputs is not None and request is not None:
                    stream = grammar_errors_named(stream, request)
                streams.append(self.logged(sub_id, stream, prompt_params.output_kind))
        except ValueError as exc:
            await engine.abort(submitted)
            raise bad_request(exc, default_param="prompt") from None
        except EngineDeadError as exc:
            raise engine_dead(exc) from None
        return streams


def top_logprobs(token_ids: list[int], logprobs: SampleLogprobs, k: int) -> SampleLogprobs:
    """Each position's chosen token and its ``k`` most likely ones (a beam search step keeps
    ``2 * n`` candidates)."""
    kept = []
    for token_id, position in zip(token_ids, logprobs):
        entries: dict[int, Logprob] = {token_id: position[token_id]} if token_id in position else {}
        for other_id, entry in sorted(position.items(), key=lambda item: -item[1].logprob)[:k]:
            entries.setdefault(other_id, entry)
        kept.append(entries)
    return kept


async def grammar_errors_named(stream: AsyncGenerator[RequestOutput, None], request: Any
                               ) -> AsyncGenerator[RequestOutput, None]:
    """``stream``, with an engine-side grammar failure naming the request's own field."""
    try:
        async for output in stream:
            yield output
    except InvalidArgumentError as exc:
        raise in_request_words(exc, request) from None
    finally:
        await stream.aclose()
