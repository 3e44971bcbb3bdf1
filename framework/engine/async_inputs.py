"""The checks on the arguments of ``AsyncLLM.add_request`` / ``generate`` and
``LLMEngine.add_request`` besides the prompt's text and sampling parameters (each refusal names its
field). (vLLM's ``AsyncEngineArgs`` is in ``sparrow.engine.arg_utils``; re-exported here.)"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

from sparrow.engine.arg_utils import AsyncEngineArgs  # noqa: F401 - re-exported
from sparrow.errors import InvalidArgumentError
from sparrow.param_checks import INT64_MAX, INT64_MIN
from sparrow.sampling_params import SamplingParams


def check_request_fields(request_id: Any, prompt: Any, arrival_time: Any, priority: Any, trace_headers: Any,
                         tokenization_kwargs: Any, data_parallel_rank: Any, data_parallel_size: int
                         ) -> tuple[int, float | None]:
    """Refuse, naming the field, what the engine core could not decode or would not honour;
    return ``priority`` and ``arrival_time`` as the wire carries them."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgumentError(f"request_id must be a non-empty string, got {request_id!r} "
                                   f"({type(request_id).__name__})", "request_id")
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral) \
            or not INT64_MIN <= int(priority) <= INT64_MAX:
        raise InvalidArgumentError(f"priority of request {request_id!r} must be a 64-bit integer, got "
                                   f"{priority!r} ({type(priority).__name__})", "priority")
    if arrival_time is not None:
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real) \
                or not math.isfinite(float(arrival_time)):
            raise InvalidArgumentError(f"arrival_time of request {request_id!r} must be a finite number "
                                       f"(time.time() seconds) or None, got {arrival_time!r}", "arrival_time")
        # vLLM's arrival_time is wall-clock (time.time()); the engine's clock is time.monotonic(),
        # which every process of the machine shares: the same instant on that clock.
        arrival_time = float(arrival_time) - (time.time() - time.monotonic())
    if trace_headers:
        raise InvalidArgumentError(f"trace_headers of request {request_id!r}: Sparrow has no request tracing "
                                   "(OpenTelemetry); leave trace_headers None", "trace_headers")
    if tokenization_kwargs:
        raise InvalidArgumentError(
            f"tokenization_kwargs of request {request_id!r} are not supported (got {sorted(tokenization_kwargs)}): "
            "pass prompt_token_ids to tokenize yourself, or SamplingParams for the output", "tokenization_kwargs")
    if data_parallel_rank is not None:
        size = data_parallel_size
        if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, numbers.Integral) \
                or not 0 <= int(data_parallel_rank) < size:
            raise InvalidArgumentError(f"data_parallel_rank of request {request_id!r} must be an integer in "
                                       f"[0, {size}) or None, got {data_parallel_rank!r}", "data_parallel_rank")
    return int(priority), arrival_time


def request_params(request_id: str, params: Any, default_sampling_params: dict[str, Any],
                   field: str) -> tuple[SamplingParams, bool]:
    """A submitted request's sampling parameters: ``params`` checked again and copied (a field may
    have been set after construction, and the caller may reuse or change it while the request
    runs), or, when None, the model's defaults; True in that case (a default max_tokens is then cut
    to the room the prompt leaves). A non-SamplingParams is refused naming ``field``."""
    if params is None:
        return SamplingParams(**default_sampling_params), True
    if not isinstance(params, SamplingParams):
        raise InvalidArgumentError(f"{field} of request {request_id!r} must be SamplingParams, got "
                                   f"{type(params).__name__}", field)
    return params.clone(), False



def check_kv_capacity(request: Any, capacity_tokens: int, max_model_len: int) -> None:
    """Refuse a request whose prompt and output could never fit the whole KV cache (it would wait
    forever), naming ``max_tokens`` when the prompt alone (and one output token) would fit."""
    needed = min(len(request.prompt_token_ids) + (request.max_tokens or 0), max_model_len)
    if needed > capacity_tokens:
        field = "max_tokens" if len(request.prompt_token_ids) < capacity_tokens else "prompt"
        raise InvalidArgumentError(
            f"request {request.request_id!r} needs KV cache for {needed} tokens but the whole cache holds "
            f"{capacity_tokens}; lower max_tokens or raise kv_cache_memory_bytes / num_kv_blocks", field)
