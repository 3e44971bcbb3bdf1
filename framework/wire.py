"""Every message that crosses a process boundary, in one leaf module.

Three boundaries, each a msgpack stream of the Structs below (and vLLM's KV cache events, which
the engine core publishes to subscribers outside the engine: KVEventBatch):

    frontend (P0)   --EngineCoreRequest-->          engine core (P1)
                    <--EngineCoreOutputs--          (after one HandshakeMessage)
    engine core     --SchedulerOutput-->            workers (P2..N)
                    <--ModelRunnerOutput--

Rules (vLLM V1's): ``msgspec.Struct(array_like=True, omit_defaults=True)``; a new field is
appended last with a default, so that the positions of the others never move; enums that cross
are ``IntEnum``. Everything here is pure Python with no torch, and this module imports nothing
from sparrow but ``sparrow.sampling_params``, ``sparrow.pooling_params`` and ``sparrow.lora.request``
(leaves): ``core/``, ``sample/``, ``engine/``, ``worker/`` and plugins all import their messages
from here without importing each other.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from sparrow.lora.request import LoRARequest
from sparrow.pooling_params import PoolingParams
from sparrow.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    REPETITION = 3  # vLLM's: SamplingParams.repetition_detection ended a looping output

    def __str__(self) -> str:
        return self.name.lower()


class TensorData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tensor as it crosses a process: its bytes in C order, its torch dtype name ("float32",
    "bfloat16", "float16") and its shape (sparrow.utils.tensor_data converts both ways)."""

    data: bytes
    dtype: str
    shape: list[int]


# -- engine core -> workers ---------------------------------------------------------------------
class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the workers have not seen, or one resumed after preemption (they forgot it)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Output so far: non-empty only for a request resumed after preemption, which is recomputed.
    output_token_ids: list[int] = []
    # Hybrid KV cache (sliding and full-attention layers): block ids of KV cache groups 1..,
    # one list each; ``block_ids`` are group 0's. Empty when every layer is in one group.
    extra_group_block_ids: list[list[int]] = []
    # The LoRA adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # vLLM's cache_salt, for the caches a worker keeps of its own (a draft model's prefix cache).
    cache_salt: str | None = None
    # A pooling model's request: its task ("token_embed" / "token_classify": pool every token).
    pooling_task: str | None = None
    # vLLM's prompt embeddings (enable_prompt_embeds): [num_prompt_tokens, hidden_size], fed to the
    # model in place of the token embeddings; prompt_token_ids then only hold placeholders (0).
    prompt_embeds: TensorData | None = None


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Requests the workers already hold; parallel lists, one entry per request."""

    req_ids: list[str] = []
    # Blocks appended since the previous step (often empty).
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []
    # Hybrid KV cache: per request, the blocks appended to each of KV cache groups 1.. (empty
    # when every layer is in one group; ``new_block_ids`` are group 0's).
    new_extra_group_block_ids: list[list[list[int]]] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the scheduler decided for one step; sent to every worker."""

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
    # under a grammar this step, and their allowed-token bitmask in this order, one row each
    # plus one per draft it has in scheduled_spec_decode_tokens (row j: the mask after drafts
    # 1..j): int32 [rows, ceil(vocab_size / 32)] as bytes; bit j of word w allows token 32 * w + j.
    # Computed once here and sent to every rank, so that tensor-parallel ranks mask identically
    # without a tokenizer or a grammar each.
    structured_output_request_ids: list[str] = []
    grammar_bitmask: bytes | None = None
    # Speculative decoding: req_id -> the draft tokens scheduled after its last token (counted in
    # num_scheduled_tokens); the workers verify them in this step's forward pass.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# -- workers -> engine core ---------------------------------------------------------------------
class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top-k (k may be 0).

    ``ranks[i]`` is the 1-based rank of ``token_ids[i]`` in the full distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a worker returns after a step."""

    # Requests of the step, in batch order.
    req_ids: list[str] = []
    # One list per request: the sampled token ids, empty while a prefill is still partial.
    sampled_token_ids: list[list[int]] = []
    # req_id -> logprobs of each sampled token (only requests that asked for logprobs).
    logprobs: dict[str, list[TokenLogprobs]] = {}
    # req_id -> logprobs of the prompt positions computed this step (prompt_logprobs requests).
    # Position i holds the logprob of prompt token i+1 given tokens [0..i].
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # Speculative decoding: per request (as req_ids), the drafts proposed for the next step
    # (empty lists, or no list at all when speculation is off).
    spec_token_ids: list[list[int]] = []
    # Pooling models: req_id -> the pooled vector of each request whose prompt completed this step,
    # float32 little-endian bytes [hidden_size] (sparrow.worker.pooler); the request is then done.
    pooler_output: dict[str, bytes] = {}


# -- frontend -> engine core --------------------------------------------------------------------
class EngineCoreRequestType(enum.Enum):
    """First frame of every message sent to the engine core (see sparrow.engine.serial)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True,
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
    # The LoRA adapter to run with (None: the base model); checked again by the engine core.
    lora_request: LoRARequest | None = None
    # A pooling model's request (runner="pooling"): what its vector is for. ``sampling_params``
    # then only carries the prompt through (nothing is sampled).
    pooling_params: PoolingParams | None = None
    # vLLM's cache_salt: keys the request's prefix-cache blocks (only the same salt shares them).
    cache_salt: str | None = None
    # vLLM's prompt embeddings (enable_prompt_embeds), [len(prompt_token_ids), hidden_size]; the
    # token ids are placeholders (0), and the embeddings key the prefix cache instead.
    prompt_embeds: TensorData | None = None
    # vLLM's data_parallel_rank: the data-parallel engine that must run it (None: the frontend picks).
    data_parallel_rank: int | None = None


# -- engine core -> frontend --------------------------------------------------------------------
class HandshakeMessage(msgspec.Struct, array_like=True, omit_defaults=True):
    """The engine core's first message: READY with its KV cache, or FAILED with a traceback."""

    status: str  # "READY" | "FAILED"
    num_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0
    error: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # The error finish: set when the engine core could not take the request (undecodable or
    # invalid payload, a value it can never run, or a failure while adding it). The output is then
    # finished with FinishReason.ABORT, and the frontends raise the error to that request's caller
    # alone (a 400 in the server); the other requests carry on.
    error_message: str | None = None
    # The request field the error is about, when the engine core knows it: the frontends then
    # raise sparrow.errors.InvalidArgumentError(error_message, error_field), else a ValueError.
    error_field: str | None = None
    # A pooling model's vector for this (finished) request: float32 little-endian bytes, as the
    # worker pooled it (the frontend applies the request's dimensions and normalize).
    pooling_output: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A snapshot of the scheduler. Gauges describe the moment; counters are cumulative since the
    engine core started and are never reset by reading them, so a rate is the difference between
    two snapshots (a Prometheus counter is fed that difference)."""

    num_running_reqs: int = 0  # gauge
    num_waiting_reqs: int = 0  # gauge
    kv_cache_usage: float = 0.0  # gauge: fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0  # counter: prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # counter: prompt tokens found there
    num_preemptions: int = 0  # counter: requests preempted
    num_free_blocks: int = 0  # gauge
    num_total_blocks: int = 0  # gauge
    kv_connector_loaded_tokens: int = 0  # counter: tokens loaded through a KV connector
    # Speculative decoding (vLLM's spec_decode_* names), counters: verification steps of a
    # request with drafts, draft tokens verified, draft tokens accepted, and per draft position
    # (0 = the first draft) the drafts accepted there; acceptance rate = accepted / draft tokens,
    # mean accepted length per step = 1 + accepted / drafts.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


# Fields of SchedulerStats that are cumulative counters (the others are gauges).
SCHEDULER_STATS_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                            "kv_connector_loaded_tokens", "spec_decode_num_drafts",
                            "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    # Set once, when the engine core is about to die; every pending request fails with it.
    engine_dead_message: str | None = None


# -- engine core -> KV event subscribers (kv_events_config; vLLM's KV cache events) ---------------
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """One change to the prefix cache; tagged with its class name in the stream, as vLLM's."""


class BlockStored(KVCacheEvent):
    """Full blocks whose KV is now cached: their hashes in order, the hash of the block before the
    first (None: they start the prompt), the tokens they hold, the block size and the request's
    LoRA adapter id (None: the base model)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks whose content was evicted (their blocks were handed out again)."""

    block_hashes: list[bytes]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was forgotten (reset_prefix_cache)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine step's events, with the wall-clock time (seconds since the epoch) they were sent."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
