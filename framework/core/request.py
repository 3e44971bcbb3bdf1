"""A request as the engine core sees it. Pure Python: no torch here."""

from __future__ import annotations

import enum
import time
from typing import Any

from sparrow.pooling_params import TOKEN_TASKS
from sparrow.sampling_params import SamplingParams
from sparrow.wire import FinishReason

__all__ = ["FinishReason", "Request", "RequestStatus"]  # FinishReason's home is sparrow.wire


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Waiting for its grammar to compile (structured outputs); skipped by admission until then.
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_REPETITION = enum.auto()  # SamplingParams.repetition_detection found a loop

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


class Request:
    """Progress is ``num_tokens`` (prompt + output so far) against ``num_computed_tokens``
    (tokens whose KV is in the cache); there is no prefill or decode phase."""

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time",
        "priority", "status", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
        "max_tokens", "stop_reason", "block_hashes", "_output_token_ids", "_all_token_ids",
        "structured_output", "lora_request", "num_output_placeholders", "cache_salt", "pooling_task",
        "prompt_embeds",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        lora_request: Any = None,
        cache_salt: str | None = None,
        pooling_task: str | None = None,
        prompt_embeds: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first scheduled; None until then.
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        # Resolved output cap: sampling_params.max_tokens, or what max_model_len leaves.
        self.max_tokens = max_tokens if max_tokens is not None else (sampling_params.max_tokens or 16)
        self.stop_reason: int | str | None = None
        # Hash of every full block of all_token_ids, in order; extended as tokens arrive.
        self.block_hashes: list[Any] = []
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # The request's grammar state (structured outputs), or None. Duck-typed so that the
        # scheduler needs no xgrammar (nor torch): ``is_ready()``, ``accept_tokens(token_ids) ->
        # bool`` and ``is_terminated()`` (see sparrow.structured_output.manager).
        self.structured_output: Any = None
        # The LoRA adapter (sparrow.lora.request.LoRARequest) or None; it keys the prefix cache.
        self.lora_request = lora_request
        # vLLM's cache_salt (None: none): it keys the prefix cache too, so that only requests with
        # the same salt share blocks (tenants isolated from each other's cache hits).
        self.cache_salt = cache_salt
        # A pooling model's request: its resolved task (None: a generation request). A token-level
        # task ("token_embed", "token_classify") reads every prompt position's hidden state.
        self.pooling_task = pooling_task
        # vLLM's prompt embeddings (sparrow.wire.TensorData [num_prompt_tokens, hidden]) or None;
        # prompt_token_ids are then placeholders, and the embeddings key the prefix cache instead.
        self.prompt_embeds = prompt_embeds
        # Overlapped (async) scheduling: tokens scheduled to be sampled by steps still running,
        # whose ids the scheduler has not seen yet (the worker feeds them to the next step itself).
        self.num_output_placeholders = 0

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's: no prompt token may come from the prefix cache, because the request asked so
        (``SamplingParams.skip_reading_prefix_cache``) or needs the model's output at every prompt
        position (prompt logprobs, token-level pooling)."""
        params = self.sampling_params
        return bool(params.skip_reading_prefix_cache) or params.prompt_logprobs is not None \
            or self.pooling_task in TOKEN_TASKS

    # -- progress ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    # -- status -----------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
