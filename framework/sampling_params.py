"""SamplingParams with vLLM's fields and defaults, validated at construction."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(
    msgspec.Struct, omit_defaults=True, array_like=True, kw_only=True  # type: ignore[call-arg]
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def fail(field: str, requirement: str, value: Any) -> None:
            raise ValueError(f"SamplingParams.{field} {requirement}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                fail(name, "must be in [-2, 2]", value)
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", "must be > 0", self.repetition_penalty)
        if not self.temperature >= 0.0:
            fail("temperature", "must be >= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]", self.top_p)
        if self.top_k < 0:
            fail("top_k", "must be -1 (disable), 0 (disable) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer or None", self.seed)
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", "must be at least 1", self.max_tokens)
        if self.min_tokens < 0:
            fail("min_tokens", "must be >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        if self.logprobs is not None and self.logprobs < 0:
            fail("logprobs", "must be >= 0", self.logprobs)
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            fail("prompt_logprobs", "must be >= 0", self.prompt_logprobs)
        assert isinstance(self.stop, list)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            fail("stop", "must be non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            fail("stop_token_ids", "must be non-negative integers", self.stop_token_ids)
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            fail("allowed_token_ids", "must be a non-empty list of non-negative token ids", self.allowed_token_ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                    fail("logit_bias", "keys must be non-negative token ids", token_id)
                if not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                    fail("logit_bias", f"values must be numbers in [-100, 100] (token {token_id})", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__)
        return f"SamplingParams({fields})"
