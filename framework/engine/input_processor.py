"""Frontend (P0) input side: validate a prompt and its SamplingParams, tokenize, and build the
``EngineCoreRequest`` the engine core receives.

Prompts come in vLLM's forms:

    "text"                                  a text prompt
    {"prompt": "text"}                      TextPrompt
    {"prompt_token_ids": [1, 2, 3]}         TokensPrompt (a "prompt" key, if any, is kept as text)
    {"prompt_embeds": tensor}               EmbedsPrompt, with enable_prompt_embeds (sparrow.engine.prompt_embeds)
    [{"role": "user", "content": "..."}]    chat messages, rendered with the chat template

Text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``) is refused here
(``sparrow.engine.text_checks``), so that the offline ``LLM`` and the server give the same error
and no tokenizer sees it. Every refusal of a request's value is
a ``sparrow.errors.InvalidArgumentError`` (a ValueError) whose ``field`` names it.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any, Union

from sparrow.engine.bad_words import request_bad_words
from sparrow.engine.prompt_embeds import check_prompt_embeds, embeds_tensor_data
from sparrow.engine.request_extras import logprob_token_ids_changes, thinking_markers
from sparrow.engine.text_checks import check_text
from sparrow.errors import InvalidArgumentError
from sparrow.sampling_params import SamplingParams
from sparrow.wire import EngineCoreRequest

PromptType = Union[str, Mapping[str, Any], Sequence[Mapping[str, Any]]]
# The keys a prompt dict may have (vLLM's TextPrompt, TokensPrompt and EmbedsPrompt, with
# cache_salt). vLLM's others (multi_modal_data, mm_processor_kwargs, ...) are refused, never dropped.
PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds", "cache_salt")

# vLLM's default cap on logprobs per position.
DEFAULT_MAX_LOGPROBS = 20
_PREVIEW_CHARS = 40
_PREVIEW_TOKENS = 8


def _dedupe(token_ids: list[int]) -> list[int]:
    return list(dict.fromkeys(token_ids))


def describe_prompt(request_id: str, text: str | None, token_ids: Sequence[Any] | None) -> str:
    """A short name for a prompt in error messages: the request id and the start of the prompt."""
    if text is not None:
        preview = text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "..."
        return f"prompt of request {request_id!r} ({preview!r})"
    shown = list(token_ids or [])[:_PREVIEW_TOKENS]
    more = ", ..." if token_ids is not None and len(token_ids) > _PREVIEW_TOKENS else ""
    return f"prompt of request {request_id!r} (token ids [{', '.join(map(str, shown))}{more}])"


def prompt_cache_salt(request_id: str, prompt: Any) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's): a non-empty string that keys the request's prefix
    cache blocks, so that only requests with the same salt share them; None without one."""
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidArgumentError(f"cache_salt of request {request_id!r} must be a non-empty string, got "
                                   f"{salt!r}", "cache_salt")
    return salt


class InputProcessor:
    """Turns (request_id, prompt, SamplingParams) into an ``EngineCoreRequest``; called by LLM,
    AsyncLLM and the API server once per request, before the request reaches the engine core.

    ``eos_token_ids`` are the model's end-of-sequence ids (from generation_config.json); the
    tokenizer's eos id is always one of them. ``tokenizer`` may be None: then only token prompts
    are accepted and nothing is detokenized.
    """

    reasoning_parser: Any = None  # the engine's reasoning parser (build_frontend sets it), for thinking budgets

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: int | Sequence[int] | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        logits_processor_classes: Sequence[type] = (),
        scheduler: str | None = None,
        pooling: Any = None,
        prompt_embeds_hidden_size: int | None = None,
    ) -> None:
        if max_model_len < 2:
            raise InvalidArgumentError(f"max_model_len must be >= 2 (one prompt and one output token), "
                                       f"got {max_model_len}", "max_model_len")
        if vocab_size < 1:
            raise InvalidArgumentError(f"vocab_size must be >= 1, got {vocab_size}", "vocab_size")
        self.tokenizer = tokenizer
        _silence_too_long_warning(tokenizer)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        # The enabled logits processors: each checks every request's params (validate_params).
        self.logits_processor_classes = list(logits_processor_classes)
        # The scheduler's name when its policy ignores Request.priority (Scheduler.uses_priority):
        # a non-zero priority is then refused, as vLLM does, rather than silently dropped.
        self.scheduler_without_priority = scheduler
        # A pooling model's checks (sparrow.engine.pooling_io.PoolingIO), or None: a generative one.
        self.pooling = pooling
        # The model's hidden size when prompts may come as embeddings (enable_prompt_embeds), else None.
        self.prompt_embeds_hidden_size = prompt_embeds_hidden_size
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        candidates = ([tokenizer_eos] if tokenizer_eos is not None else []) + list(eos_token_ids or [])
        for token_id in candidates:
            if not 0 <= token_id < vocab_size:
                raise InvalidArgumentError(f"eos_token_ids: {token_id} is outside the vocabulary [0, {vocab_size})",
                                           "eos_token_ids")
        # The first is the request's eos_token_id; the engine core reports the others as stop
        # token ids, as vLLM does with a generation config listing several.
        self.eos_token_ids: list[int] = _dedupe(candidates)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # -- prompts ----------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        content_format: str = "auto",
        documents: Sequence[Mapping[str, str]] | None = None,
    ) -> str:
        """Render chat messages to the prompt text, as transformers' ``apply_chat_template`` does
        (``sparrow.engine.chat_render.render_chat``: every refusal names its field)."""
        from sparrow.engine.chat_render import render_chat

        return render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template=chat_template, tools=tools,
                           chat_template_kwargs=chat_template_kwargs, content_format=content_format,
                           documents=documents)

    def tokenize(self, text: str, *, add_special_tokens: bool = True, truncate_prompt_tokens: int | None = None,
                 field: str = "prompt") -> list[int]:
        """Token ids of ``text`` (checked to be valid Unicode first), kept to the last
        ``truncate_prompt_tokens`` when that is set."""
        check_text(field, text)
        return self.truncate(self._encode(text, add_special_tokens=add_special_tokens), truncate_prompt_tokens)

    def truncate(self, token_ids: list[int], truncate_prompt_tokens: int | None, longest: int | None = None
                 ) -> list[int]:
        """The last ``truncate_prompt_tokens`` of ``token_ids`` (all of them when None). -1 keeps
        ``longest``: by default ``max_model_len - 1``, the longest prompt that leaves room for one
        output token (a pooling prompt may be ``max_model_len`` long)."""
        if truncate_prompt_tokens is None:
            return token_ids
        keep = truncate_prompt_tokens
        if isinstance(keep, bool) or not isinstance(keep, numbers.Integral):
            raise InvalidArgumentError(f"truncate_prompt_tokens must be an int, got {type(keep).__name__}",
                                       "truncate_prompt_tokens")
        if keep == -1:
            keep = self.max_model_len - 1 if longest is None else longest
        elif not 1 <= keep <= self.max_model_len:
            raise InvalidArgumentError(f"truncate_prompt_tokens must be -1 or between 1 and "
                                       f"max_model_len={self.max_model_len}, got {keep}", "truncate_prompt_tokens")
        return token_ids[-keep:]

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgumentError("prompt: text prompts need a tokenizer; pass {'prompt_token_ids': [...]}",
                                       "prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def tokenize_prompt(self, request_id: str, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None for a token prompt) and its token ids, not yet validated."""
        label = f"prompt of request {request_id!r}"
        if isinstance(prompt, str):
            check_text("prompt", prompt, label)
            return prompt, self._encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Mapping):
            for key, value in prompt.items():
                if key not in PROMPT_KEYS and value is not None:
                    raise InvalidArgumentError(
                        f"{label}: key {key!r} is not supported (Sparrow takes text, token ids or embeddings: no "
                        f"multi-modal data); a prompt dict takes {', '.join(PROMPT_KEYS)}",
                        f"prompt.{key}")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InvalidArgumentError(f"{label}: 'prompt' must be a string, got {type(text).__name__}", "prompt")
            check_text("prompt", text, label)
            if prompt.get("prompt_embeds") is not None:
                raise InvalidArgumentError(f"{label}: a prompt given as prompt_embeds has no token ids to read "
                                           "here", "prompt_embeds")
            token_ids = prompt.get("prompt_token_ids")
            if token_ids is not None:
                return text, self._check_token_id_types(request_id, token_ids)
            if text is not None:
                return text, self._encode(text, add_special_tokens=True)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            text = self.apply_chat_template(prompt, add_generation_prompt=True)
            # The template already wrote every special token the model expects.
            return text, self._encode(text, add_special_tokens=False)
        raise InvalidArgumentError(
            f"{label} must be a str, {{'prompt': str}}, "
            f"{{'prompt_token_ids': [int, ...]}} or a list of chat messages, got {type(prompt).__name__}", "prompt"
        )

    @staticmethod
    def _check_token_id_types(request_id: str, token_ids: Any) -> list[int]:
        if getattr(token_ids, "ndim", None) == 1 and hasattr(token_ids, "tolist"):  # a numpy array, a tensor
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InvalidArgumentError(f"prompt_token_ids of request {request_id!r} must be a list of ints, got "
                                       f"{type(token_ids).__name__}", "prompt_token_ids")
        for position, token_id in enumerate(token_ids):
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                raise InvalidArgumentError(f"prompt_token_ids of request {request_id!r}: position {position} holds "
                                           f"{token_id!r}, not an int", f"prompt_token_ids[{position}]")
        return [int(token_id) for token_id in token_ids]

    # -- the request ------------------------------------------------------------------------
    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: Any = None,
        default_max_tokens: bool = False,
        pooling_params: Any = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenize one prompt; return its text (None for token prompts) and the
        request for the engine core. ``params`` is not modified: the request carries a copy
        with ``max_tokens`` and ``all_stop_token_ids`` resolved. ``default_max_tokens``: the
        caller did not choose ``params.max_tokens`` (the model's generation config did), so it is
        cut to the room the prompt leaves instead of refused, as vLLM does with a default.
        ``pooling_params``: a pooling model's request (``params`` then only carry the prompt)."""
        if (pooling_params is None) != (self.pooling is None):
            raise InvalidArgumentError(
                f"request {request_id!r}: " + ("this engine runs a pooling (embedding) model (runner='pooling'): "
                                               "use LLM.embed / encode or /v1/embeddings, not text generation"
                                               if self.pooling is not None else
                                               "pooling needs an engine started with runner='pooling'"),
                "pooling_params" if pooling_params is not None else "sampling_params")
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(
                f"sampling_params of request {request_id!r} must be SamplingParams, got {type(params).__name__}",
                "sampling_params")
        if priority and self.scheduler_without_priority is not None:
            raise InvalidArgumentError(f"priority {priority} of request {request_id!r}: the "
                                       f"{self.scheduler_without_priority!r} scheduler does not order requests by "
                                       "priority; start the engine with scheduler='priority' (or a policy that "
                                       "uses priorities) or leave priority at 0", "priority")
        cache_salt = prompt_cache_salt(request_id, prompt)
        embeds = self.prompt_embeds(request_id, prompt, params)
        if embeds is not None and pooling_params is not None:
            raise InvalidArgumentError(f"request {request_id!r}: a pooling model takes text or token ids, not "
                                       "prompt_embeds", "prompt_embeds")
        if embeds is None:
            text, token_ids = self.tokenize_prompt(request_id, prompt)
        else:  # placeholders: the engine core counts and schedules the positions
            text, token_ids = None, [0] * int(embeds.shape[0])
        # A pooling prompt generates nothing, so it may fill max_model_len (as in vLLM).
        longest = self.max_model_len if pooling_params is not None else self.max_model_len - 1
        if params.truncate_prompt_tokens is not None:  # vLLM's: the prompt's last k tokens
            token_ids = self.truncate(token_ids, params.truncate_prompt_tokens, longest)
            if embeds is not None:
                embeds = embeds[embeds.shape[0] - len(token_ids):]
        name = describe_prompt(request_id, text, token_ids) if embeds is None else \
            f"prompt of request {request_id!r} ({len(token_ids)} embeddings)"
        self._validate_prompt(name, token_ids, longest)
        if default_max_tokens and params.max_tokens is not None \
                and len(token_ids) + params.max_tokens > self.max_model_len:
            params = params.clone(max_tokens=max(self.max_model_len - len(token_ids), 1))
        if pooling_params is None:  # a pooling request's params only carry its prompt: nothing to resolve
            params = self._resolve_params(name, token_ids, params)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            # The engine core's clock: time.monotonic() is shared by every process of the machine.
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            max_tokens=params.max_tokens,
            lora_request=lora_request,  # checked against the engine's LoRA settings by the caller
            pooling_params=pooling_params,
            cache_salt=cache_salt,
            prompt_embeds=None if embeds is None else embeds_tensor_data(embeds),
        )
        return text, request

    def prompt_embeds(self, request_id: str, prompt: PromptType, params: SamplingParams) -> Any:
        """A prompt dict's checked ``prompt_embeds`` tensor, or None for a prompt of text or ids."""
        if not isinstance(prompt, Mapping) or prompt.get("prompt_embeds") is None:
            return None
        label = f"prompt of request {request_id!r}"
        embeds = check_prompt_embeds(label, prompt["prompt_embeds"], self.prompt_embeds_hidden_size)
        for key in ("prompt", "prompt_token_ids"):
            if prompt.get(key) is not None:
                raise InvalidArgumentError(f"{label}: give prompt_embeds or {key}, not both", key)
        if params.prompt_logprobs is not None:
            raise InvalidArgumentError(f"{label}: prompt_logprobs are not available for a prompt given as "
                                       "prompt_embeds (it has no token ids to score)", "prompt_logprobs")
        return embeds

    def _validate_prompt(self, name: str, token_ids: list[int], longest: int) -> None:
        if not token_ids:
            raise InvalidArgumentError(f"{name} is empty; a prompt needs at least one token", "prompt")
        for position, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise InvalidArgumentError(f"{name}: token id {token_id} at position {position} is outside the "
                                           f"vocabulary [0, {self.vocab_size})", "prompt")
        if len(token_ids) > longest:
            what = "is longer than" if longest == self.max_model_len else "leaves no room for an output token under"
            raise InvalidArgumentError(f"{name} is {len(token_ids)} tokens long, which {what} "
                                       f"max_model_len={self.max_model_len}", "prompt")

    def _resolve_params(self, name: str, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        prompt_len = len(prompt_token_ids)
        room = self.max_model_len - prompt_len
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise InvalidArgumentError(
                f"max_tokens={max_tokens} is too large for {name}: {prompt_len} prompt tokens + {max_tokens} output "
                f"tokens exceed max_model_len={self.max_model_len}; max_tokens can be at most {room}", "max_tokens")
        for field_name in ("logprobs", "prompt_logprobs"):
            value = shown = getattr(params, field_name)
            if value == -1:  # vLLM's: every token of the vocabulary
                value, shown = self.vocab_size, f"-1 (the whole vocabulary, {self.vocab_size})"
                params = params.clone(**{field_name: value})
            if value is not None and value > self.max_logprobs:
                raise InvalidArgumentError(
                    f"{field_name}={shown} exceeds the maximum of {self.max_logprobs} for {name} (the engine argument "
                    "max_logprobs)", field_name)
        check_text("stop", params.stop)
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise InvalidArgumentError(f"stop strings {params.stop!r} need detokenize=True and a tokenizer ({name})",
                                       "stop")
        if params.min_tokens > max_tokens:
            raise InvalidArgumentError(f"min_tokens={params.min_tokens} exceeds the {max_tokens} output tokens {name} "
                                       "has room for", "min_tokens")
        stop_token_ids = list(params.stop_token_ids or [])
        for token_id in stop_token_ids:
            if token_id >= self.vocab_size:
                raise InvalidArgumentError(f"stop_token_ids: {token_id} is outside the vocabulary "
                                           f"[0, {self.vocab_size}) ({name})", "stop_token_ids")
        for field_name, token_ids in (("logit_bias", params.logit_bias or {}),
                                      ("allowed_token_ids", params.allowed_token_ids or []),
                                      ("logprob_token_ids", params.logprob_token_ids or [])):
            for token_id in token_ids:
                if token_id >= self.vocab_size:
                    raise InvalidArgumentError(f"{field_name}: token id {token_id} is outside the vocabulary "
                                               f"[0, {self.vocab_size}) ({name})", field_name)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidArgumentError(f"structured_outputs need a tokenizer, and this engine has none "
                                           f"(skip_tokenizer_init=True) ({name})", "structured_outputs")
            # Parsed here, so that a bad schema, regex or grammar is the caller's ValueError (a
            # 400) and never reaches the engine core; xgrammar is imported only when used.
            from sparrow.structured_output.grammar import check_structured_outputs

            check_structured_outputs(params.structured_outputs)
        eos_ids = [] if params.ignore_eos else self.eos_token_ids
        stop_token_ids = _dedupe(stop_token_ids + eos_ids[1:])
        resolved = params.clone(
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            all_stop_token_ids=_dedupe(eos_ids[:1] + stop_token_ids),
            bad_words_token_ids=request_bad_words(self.tokenizer, self.vocab_size, name, params),
            thinking_markers=thinking_markers(self.reasoning_parser, prompt_token_ids, name, params),
            **logprob_token_ids_changes(params, self.max_logprobs, name),
        )
        for processor_cls in self.logits_processor_classes:
            processor_cls.validate_params(resolved)
        return resolved


# The key under which a transformers tokenizer records that it has shown its warning
# "Token indices sequence length is longer than the specified maximum sequence length".
_TOO_LONG_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


def _silence_too_long_warning(tokenizer: Any) -> None:
    """Mark that one transformers warning as already shown: every prompt's length is checked
    against max_model_len here, and a prompt too long is refused with its own message, which the
    warning (against the tokenizer's model_max_length) would only precede."""
    shown = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(shown, dict):
        shown[_TOO_LONG_WARNING] = True
