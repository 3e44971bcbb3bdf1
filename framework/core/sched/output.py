"""What the scheduler decided for one step; crosses to the workers (msgspec, no torch)."""

from __future__ import annotations

from typing import Any

import msgspec

from sparrow.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """A request the workers have not seen, or one resumed after preemption (they forgot it)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Output so far: non-empty only for a request resumed after preemption, which is recomputed.
    output_token_ids: list[int] = []


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """Requests the workers already hold; parallel lists, one entry per request."""

    req_ids: list[str] = []
    # Blocks appended since the previous step (often empty).
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    # req_id -> num_scheduled_tokens
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    # Requests that finished or were preempted since the last step: the workers drop their state.
    finished_req_ids: list[str] = []
    # Opaque data from the scheduler side of a KV connector to its worker side.
    kv_connector_metadata: Any = None
    # Structured outputs, filled by the engine core after scheduling: the requests that sample
    # under a grammar this step, and their allowed-token bitmask, one row each in this order:
    # int32 [len(structured_output_request_ids), ceil(vocab_size / 32)] as bytes; bit j of word w
    # allows token 32 * w + j. Computed once here and sent to every rank, so that tensor-parallel
    # ranks mask identically without a tokenizer or a grammar each.
    structured_output_request_ids: list[str] = []
    grammar_bitmask: bytes | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
