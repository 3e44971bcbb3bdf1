"""What a user gets back: vLLM's ``RequestOutput``, ``CompletionOutput`` and ``Logprob``.

In-process types (plain dataclasses); they never cross the process boundary, the engine core
sends ``EngineCoreOutput`` and the frontend's output processor builds these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparrow.logprobs import FlatLogprobs, Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "CompletionOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "FlatLogprobs", "Logprob", "PoolingOutput", "PoolingRequestOutput",
           "PromptLogprobs", "RequestMetrics", "RequestOutput", "SampleLogprobs", "ScoringOutput",
           "ScoringRequestOutput"]


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps of one request, in ``time.monotonic()`` seconds (the engine core's clock).

    ``first_token_time`` and ``last_token_time`` are when the frontend received the first and the
    latest output tokens; ``finished_time`` when it saw the request finish.
    """

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    def snapshot(self) -> RequestMetrics:
        # Each RequestOutput gets its own copy: the live one keeps changing (cheaper than replace()).
        return RequestMetrics(
            self.arrival_time, self.first_token_time, self.last_token_time, self.finished_time,
            self.num_generation_tokens,
        )

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def mean_inter_token_latency(self) -> float | None:
        # Tokens after the first arrive over (last - first); a single token has no gap to measure.
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (a request with ``n`` > 1 has ``n`` of them).

    ``finish_reason`` is "stop", "length" or "abort" once finished, else None; ``stop_reason``
    is the stop string or stop token id that ended it (None for EOS or any other reason).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})"
        )


@dataclass(slots=True)
class RequestOutput:
    """Everything a request has produced so far (or, in DELTA mode, since the last output).

    ``prompt`` is None when the request came as token ids. ``outputs`` is sorted by index.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # vLLM's fields for LoRA and encoder-decoder models: unused here, kept so that positional
    # arguments line up with vLLM's constructor.
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # The prompt's length in positions; None: len(prompt_token_ids). Set by the engine for every
    # request, so that a prompt given as embeddings (prompt_token_ids None, as vLLM's) counts too.
    num_prompt_tokens: int | None = None

    @property
    def prompt_length(self) -> int:
        """How many positions the prompt has, whether it came as text, token ids or embeddings."""
        if self.num_prompt_tokens is not None:
            return self.num_prompt_tokens
        return len(self.prompt_token_ids or ())

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        Used by a consumer that fell behind: with ``aggregate`` (DELTA outputs) the texts, token
        ids and logprobs of each completion are appended; otherwise the later completion
        replaces the earlier one.
        """
        if next_output.request_id != self.request_id:
            raise ValueError(
                f"request_id {next_output.request_id!r} cannot be merged into request {self.request_id!r}"
            )
        self.finished |= next_output.finished
        self.metrics = next_output.metrics
        if next_output.num_cached_tokens is not None:
            self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.kv_transfer_params is not None:
            self.kv_transfer_params = next_output.kv_transfer_params
        if next_output.prompt_logprobs:
            self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {completion.index: position for position, completion in enumerate(self.outputs)}
        for completion in next_output.outputs:
            position = by_index.get(completion.index)
            if position is None:
                self.outputs.append(completion)
                continue
            if not aggregate:
                self.outputs[position] = completion
                continue
            merged = self.outputs[position]
            merged.text += completion.text
            merged.token_ids = list(merged.token_ids) + list(completion.token_ids)
            if completion.logprobs is not None:
                merged.logprobs = (merged.logprobs or []) + completion.logprobs
            merged.cumulative_logprob = completion.cumulative_logprob
            merged.finish_reason = completion.finish_reason
            merged.stop_reason = completion.stop_reason
        self.outputs.sort(key=lambda completion: completion.index)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


# -- pooling models (runner="pooling") ---------------------------------------------------------
@dataclass(slots=True)
class PoolingOutput:
    """A pooling model's vector for one prompt: ``data`` is a float32 ``torch.Tensor`` [dimensions]
    (None for a request that was aborted)."""

    data: Any

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's output of ``LLM.encode`` / ``AsyncLLM.encode``: one vector for a prompt."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """The vector of ``LLM.embed``, as a list of floats."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        return EmbeddingOutput(_pooled_vector(pooling_output, "an embedding").tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's output of ``LLM.embed``: ``outputs.embedding`` is the prompt's vector."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(request_output.request_id, EmbeddingOutput.from_base(request_output.outputs),
                                      request_output.prompt_token_ids, request_output.finished,
                                      request_output.num_cached_tokens, request_output.prompt)


def _pooled_vector(pooling_output: PoolingOutput, what: str) -> Any:
    data = pooling_output.data
    if data is None:
        raise ValueError("the request finished without a vector: it was aborted, or the platform's workers do "
                         "not pool (a platform plugin without pooling support)")
    if getattr(data, "ndim", 1) != 1:
        raise ValueError(f"{what} is one vector; got data of shape {tuple(data.shape)}")
    return data


@dataclass(slots=True)
class ClassificationOutput:
    """A classifier's outputs for one prompt, one per label (``LLM.classify``): probabilities
    after its activation (softmax, or sigmoid for one label), or logits with ``use_activation=False``."""

    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        return ClassificationOutput(_pooled_vector(pooling_output, "a classification").tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """vLLM's output of ``LLM.classify``: ``outputs.probs`` for one prompt."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(
            request_output.request_id, ClassificationOutput.from_base(request_output.outputs),
            request_output.prompt_token_ids, request_output.finished, request_output.num_cached_tokens,
            request_output.prompt)


@dataclass(slots=True)
class ScoringOutput:
    """The score of one pair of texts: an embedding model's cosine similarity of their vectors,
    or a cross-encoder's output for both texts read together."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """vLLM's output of ``LLM.score``: ``outputs.score`` for one pair; ``prompt_token_ids`` are
    both texts' tokens, one after the other, and ``request_id`` joins both requests' ids."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
