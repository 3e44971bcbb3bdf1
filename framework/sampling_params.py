"""SamplingParams with vLLM's fields and defaults, validated at construction.

Validation runs in the caller (construction) and again in the engine core (msgspec calls
``__post_init__`` when it decodes the request), so a value the caller accepted can never make the
engine core fail to decode a request. Every field is checked for its type as well as its range:
integers are Python or numpy integers (never bool, float or str), floats are finite numbers, and
every integer fits the 64-bit integers the wire (msgpack) and the sampler carry.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from sparrow.errors import InvalidArgumentError
from sparrow.param_checks import INT64_MAX, INT64_MIN, _bool, _fail, _float, _int, _token_ids  # noqa: F401
from sparrow.sampling_options import (  # noqa: F401 - re-exported: vLLM's users import them from here
    STRUCTURED_OUTPUT_KINDS,
    STRUCTURED_OUTPUT_OPTIONS,
    GuidedDecodingParams,
    RepetitionDetectionParams,
    StructuredOutputsParams,
    ThinkingMarkers,
)

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


# SamplingParams fields that are read once and are always None afterwards (not shown in its repr).
_OLDER_NAMES = ("guided_decoding", "logits_processors")

class SamplingParams(
    msgspec.Struct, omit_defaults=True, array_like=True, kw_only=True,  # type: ignore[call-arg]
    forbid_unknown_fields=True,
):
    """How to sample one request's output (vLLM's names, meanings and defaults).

    ``top_k`` of 0 or -1 and ``top_p`` of 1 disable those filters; ``temperature`` 0 is greedy.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # token id -> value added to its logit before sampling (OpenAI's range: -100 to 100)
    logit_bias: dict[int, float] | None = None
    # only these token ids may be sampled (every other logit is -inf)
    allowed_token_ids: list[int] | None = None
    # Filled in by the input processor from the model's generation config; appended last.
    all_stop_token_ids: list[int] | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar); appended after the fields above.
    structured_outputs: StructuredOutputsParams | None = None
    # Words that may not be generated (vLLM's semantics, see sparrow.sample.logits_processor.words);
    # appended after the fields above, like the two that follow.
    bad_words: list[str] | None = None
    # bad_words as token-id sequences: filled in by the input processor from bad_words (each word
    # with and without a leading space); ids given here directly are banned too.
    bad_words_token_ids: list[list[int]] | None = None
    # Per-request arguments for custom logits processors (vLLM's extra_args; the server's
    # vllm_xargs): JSON-like values, str keys.
    extra_args: dict[str, Any] | None = None
    # Keep only the prompt's last k tokens (-1: as many as max_model_len leaves room for one output
    # token); applied by the input processor when the request is made. Appended last.
    truncate_prompt_tokens: int | None = None
    # vLLM's older names, read once and never carried: guided_decoding (before 0.11) is moved to
    # structured_outputs; per-request logits_processors (callables) are refused, as vLLM V1 does.
    guided_decoding: StructuredOutputsParams | None = None
    logits_processors: list[Any] | None = None
    # vLLM's per-request stream_interval: this request's streamed outputs wait for at least this many
    # new tokens (at least the engine's stream_interval; its first and last outputs come at once).
    stream_interval: int | None = None
    # vLLM's repetition detection: the request ends (finish_reason "repetition") once its output
    # ends with a pattern repeated min_count times (sparrow.sampling_options).
    repetition_detection: RepetitionDetectionParams | None = None
    # vLLM's thinking_token_budget: at most this many tokens inside the reasoning, then its end
    # marker is forced (needs the engine's reasoning_parser; -1 or None: no limit).
    thinking_token_budget: int | None = None
    # The reasoning's markers for the budget: filled in by the input processor (sparrow.sampling_options).
    thinking_markers: ThinkingMarkers | None = None
    # vLLM's logprob_token_ids: these tokens' logprobs at every generated position, beside the sampled
    # token's (and the top `logprobs`, when set); at most the engine's max_logprobs ids.
    logprob_token_ids: list[int] | None = None
    # vLLM's: True computes the whole prompt, reading nothing from the prefix cache (what it computes
    # is still cached for others); None: only when prompt_logprobs need every prompt position.
    skip_reading_prefix_cache: bool | None = None
    # vLLM's: logprobs and prompt_logprobs come as a sparrow.logprobs.FlatLogprobs (flat lists that
    # read as the list of dicts), which costs the garbage collector far less on long outputs.
    flat_logprobs: bool = False

    def __post_init__(self) -> None:
        self._check_older_names()
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _check_older_names(self) -> None:
        if self.logits_processors:
            _fail("logits_processors", "is not supported per request (nor by vLLM V1): register the processor "
                  "with the engine argument logits_processors and give it this request's arguments in "
                  "extra_args", self.logits_processors)
        self.logits_processors = None
        if self.guided_decoding is None:
            return
        if not isinstance(self.guided_decoding, StructuredOutputsParams):
            _fail("guided_decoding", "must be a GuidedDecodingParams (StructuredOutputsParams)", self.guided_decoding)
        if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
            _fail("guided_decoding", "is vLLM's older name of structured_outputs; give one of the two",
                  self.guided_decoding)
        warnings.warn("SamplingParams.guided_decoding is vLLM's older name: use structured_outputs "
                      "(GuidedDecodingParams is StructuredOutputsParams)", DeprecationWarning, stacklevel=3)
        self.structured_outputs, self.guided_decoding = self.guided_decoding, None

    def _check_types(self) -> None:
        """Normalise every field to the exact type the wire carries, or raise naming it."""
        self.n = _int("n", self.n, 1)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                     "top_p", "min_p"):
            setattr(self, name, _float(name, getattr(self, name)))
        self.top_k = _int("top_k", self.top_k)
        # Children of an n > 1 request are seeded seed, seed + 1, ...: a signed 64-bit seed keeps
        # them inside the unsigned 64-bit integers msgpack carries.
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens)
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            if self.truncate_prompt_tokens == 0:
                _fail("truncate_prompt_tokens", "must be -1, a positive integer or None", 0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _int(name, getattr(self, name)))
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "flat_logprobs"):
            setattr(self, name, _bool(name, getattr(self, name)))
        if isinstance(self.output_kind, bool) or self.output_kind not in tuple(RequestOutputKind):
            _fail("output_kind", f"must be one of {[kind.name for kind in RequestOutputKind]}", self.output_kind)
        self.output_kind = RequestOutputKind(self.output_kind)
        self._check_stop()
        self.stop_token_ids = [] if self.stop_token_ids is None else _token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.all_stop_token_ids is not None:
            self.all_stop_token_ids = _token_ids("all_stop_token_ids", self.all_stop_token_ids)
        if self.logit_bias is not None:
            self._check_logit_bias()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", "must be a StructuredOutputsParams", self.structured_outputs)
        if self.bad_words is not None:
            self._check_bad_words()
        if self.bad_words_token_ids is not None:
            if isinstance(self.bad_words_token_ids, (str, bytes, Mapping)) or not isinstance(
                    self.bad_words_token_ids, Iterable):
                _fail("bad_words_token_ids", "must be a list of token-id lists", self.bad_words_token_ids)
            checked = [_token_ids(f"bad_words_token_ids[{index}]", ids)
                       for index, ids in enumerate(self.bad_words_token_ids)]
            for index, ids in enumerate(checked):
                if not ids:
                    _fail(f"bad_words_token_ids[{index}]", "must hold at least one token id", ids)
            self.bad_words_token_ids = checked
        if self.extra_args is not None:
            self._check_extra_args()
        if self.stream_interval is not None:
            self.stream_interval = _int("stream_interval", self.stream_interval, 1)
        if isinstance(self.repetition_detection, Mapping):
            self.repetition_detection = _from_mapping(RepetitionDetectionParams, "repetition_detection",
                                                      self.repetition_detection)
        if self.repetition_detection is not None and not isinstance(self.repetition_detection,
                                                                    RepetitionDetectionParams):
            _fail("repetition_detection", "must be a RepetitionDetectionParams", self.repetition_detection)
        if self.thinking_token_budget is not None:
            budget = _int("thinking_token_budget", self.thinking_token_budget, -1)
            self.thinking_token_budget = None if budget == -1 else budget
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(dict.fromkeys(_token_ids("logprob_token_ids", self.logprob_token_ids)))
            if not self.logprob_token_ids:
                _fail("logprob_token_ids", "must hold at least one token id", self.logprob_token_ids)
        if self.skip_reading_prefix_cache is not None:
            self.skip_reading_prefix_cache = _bool("skip_reading_prefix_cache", self.skip_reading_prefix_cache)
            if not self.skip_reading_prefix_cache and self.prompt_logprobs is not None:
                _fail("skip_reading_prefix_cache", "cannot be False with prompt_logprobs (they need every prompt "
                      "position computed)", False)
        if self.thinking_markers is not None and not isinstance(self.thinking_markers, ThinkingMarkers):
            _fail("thinking_markers", "must be a ThinkingMarkers (the input processor fills it in)",
                  self.thinking_markers)

    def _check_stop(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, bytes) or not isinstance(stop, Sequence):
            _fail("stop", "must be a string or a list of strings", stop)
        for index, text in enumerate(stop):
            if not isinstance(text, str) or text == "":
                _fail(f"stop[{index}]", "must be a non-empty string", text)
        self.stop = list(stop)

    def _check_bad_words(self) -> None:
        words = self.bad_words
        if isinstance(words, (str, bytes, Mapping)) or not isinstance(words, Iterable):
            _fail("bad_words", "must be a list of strings", words)
        words = list(words)
        for index, word in enumerate(words):
            if not isinstance(word, str) or not word.strip():
                _fail(f"bad_words[{index}]", "must be a string with a non-space character", word)
        self.bad_words = words

    def _check_extra_args(self) -> None:
        if not isinstance(self.extra_args, Mapping):
            _fail("extra_args", "must be a dict with string keys", self.extra_args)
        for key in self.extra_args:
            if not isinstance(key, str):
                _fail("extra_args", "must have string keys", key)
        # The dict travels to the engine core inside the request: what msgpack cannot carry is
        # refused here, in the caller, rather than failing the request in the engine.
        try:
            msgspec.msgpack.encode(self.extra_args)
        except (TypeError, OverflowError) as exc:
            raise InvalidArgumentError(f"SamplingParams.extra_args must hold only JSON-like values (str, int, "
                                       f"float, bool, None, lists and dicts of them): {exc}", "extra_args") from None
        self.extra_args = dict(self.extra_args)

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, Mapping):
            _fail("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
        checked: dict[int, float] = {}
        for token_id, bias in self.logit_bias.items():
            token_id = _int("logit_bias key", token_id, 0, path="logit_bias")
            bias = _float(f"logit_bias[{token_id}]", bias)
            if not -100.0 <= bias <= 100.0:
                _fail(f"logit_bias[{token_id}]", "must be in [-100, 100]", bias)
            checked[token_id] = bias
        self.logit_bias = checked

    def _verify(self) -> None:
        """Ranges, once every field has its type."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                _fail(name, "must be in [-2, 2]", value)
        if not self.repetition_penalty > 0.0:
            _fail("repetition_penalty", "must be > 0", self.repetition_penalty)
        if not self.temperature >= 0.0:
            _fail("temperature", "must be >= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        if self.top_k < 0:
            _fail("top_k", "must be -1 (disable), 0 (disable) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", "must be in [0, 1]", self.min_p)
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", "must be at least 1", self.max_tokens)
        if self.min_tokens < 0:
            _fail("min_tokens", "must be >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        # -1 (vLLM's): the whole vocabulary, resolved by the engine's input processor.
        if self.logprobs is not None and self.logprobs < -1:
            _fail("logprobs", "must be >= 0, or -1 for the whole vocabulary", self.logprobs)
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            _fail("prompt_logprobs", "must be >= 0, or -1 for the whole vocabulary", self.prompt_logprobs)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            _fail("allowed_token_ids", "must be a non-empty list of non-negative token ids", self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f not in _OLDER_NAMES)
        return f"SamplingParams({fields})"


def _from_mapping(cls: Any, field: str, values: Mapping[str, Any]) -> Any:
    """``cls(**values)``, an unknown key refused naming the field and the key."""
    unknown = sorted(set(values) - set(cls.__struct_fields__))
    if unknown:
        raise InvalidArgumentError(f"{field} has no field {unknown[0]!r}; its fields are "
                                   f"{', '.join(cls.__struct_fields__)}", f"{field}.{unknown[0]}")
    return cls(**values)


class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, for ``LLM.beam_search`` (sparrow.beam_search): keep the
    ``beam_width`` most likely sequences, extending each by one token ``max_tokens`` times.

    ``length_penalty`` divides a finished sequence's cumulative logprob by its length (prompt
    included, a final EOS not) to this power when the sequences are ranked; ``temperature`` is the
    temperature of the one sampled token each step adds to the candidates (0: none beyond the top
    ``2 * beam_width``); ``include_stop_str_in_output`` keeps a final EOS token's text in ``text``.
    Invalid values raise ``ValueError`` naming the field.
    """

    __slots__ = ("beam_width", "max_tokens", "ignore_eos", "temperature", "length_penalty",
                 "include_stop_str_in_output")

    def __init__(self, beam_width: int, max_tokens: int, ignore_eos: bool = False, temperature: float = 0.0,
                 length_penalty: float = 1.0, include_stop_str_in_output: bool = False) -> None:
        try:
            self.beam_width = _int("beam_width", beam_width, 1)
            self.max_tokens = _int("max_tokens", max_tokens, 1)
            self.ignore_eos = _bool("ignore_eos", ignore_eos)
            self.temperature = _float("temperature", temperature)
            if self.temperature < 0:
                _fail("temperature", "must be >= 0", temperature)
            self.length_penalty = _float("length_penalty", length_penalty)
            self.include_stop_str_in_output = _bool("include_stop_str_in_output", include_stop_str_in_output)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(str(exc).replace("SamplingParams.", "BeamSearchParams.", 1),
                                       exc.field) from None

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"BeamSearchParams({fields})"
