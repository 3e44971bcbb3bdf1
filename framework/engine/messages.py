"""Messages between the frontend (P0) and the engine core (P1): msgspec Structs, new fields last."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from sparrow.core.request import FinishReason
from sparrow.sampling_params import SamplingParams
from sparrow.worker.outputs import TokenLogprobs


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True,  # type: ignore[call-arg]
                        forbid_unknown_fields=True):
    # Decoded in the engine core with every field type-checked (an extra trailing field is an
    # error too); a payload that fails is answered with an error output, never a dead core.
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    # Output cap after max_model_len is taken into account (the input processor resolves it).
    max_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    client_index: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # The error finish: set when the engine core could not take the request (undecodable or
    # invalid payload, a value it can never run, or a failure while adding it). The output is then
    # finished with FinishReason.ABORT, and the frontends raise ValueError(error_message) to that
    # request's caller alone (a 400 in the server); the other requests carry on.
    error_message: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up since the last stats (delta)
    prefix_cache_hits: int = 0  # tokens found since the last stats (delta)
    num_preemptions: int = 0  # preemptions since the last stats (delta)
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_connector_loaded_tokens: int = 0  # tokens loaded through a KV connector since the last stats (delta)


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    engine_index: int = 0
    # Set once, when the engine core is about to die; every pending request fails with it.
    engine_dead_message: str | None = None


class EngineCoreRequestType(enum.Enum):
    """First frame of every message sent to the engine core."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
