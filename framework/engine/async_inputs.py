"""What ``AsyncLLM`` takes besides prompts: vLLM's ``AsyncEngineArgs``, and the checks on the
arguments of ``AsyncLLM.add_request`` / ``generate`` (each refusal names its field)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from sparrow.config import ConfigError, EngineConfig
from sparrow.errors import InvalidArgumentError

# The keys a prompt dict may have. vLLM's other keys (multi_modal_data, mm_processor_kwargs,
# cache_salt, token_type_ids, prompt_embeds, ...) are refused, never dropped: Sparrow serves
# text-only models and has no cache salts.
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class AsyncEngineArgs:
    """vLLM's ``AsyncEngineArgs``: the engine arguments as one object, for
    ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., max_model_len=...))``.

    Takes the keywords ``LLM`` and ``AsyncLLM.from_engine_args`` take; every argument is an
    attribute (unset ones read as their defaults) and may be reassigned before the engine is built.
    An unknown name raises ``ConfigError`` at once; values are checked by ``create_engine_config``.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        object.__setattr__(self, "_args", {})
        self.model = model
        for name, value in engine_args.items():
            setattr(self, name, value)

    @staticmethod
    def _check_name(name: str) -> None:
        owners = EngineConfig.field_names()
        if name not in owners:
            raise ConfigError(f"unknown engine argument {name!r}; valid arguments: {', '.join(sorted(owners))}")

    def __setattr__(self, name: str, value: Any) -> None:
        self._check_name(name)
        self._args[name] = value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        self._check_name(name)
        args = self.__dict__["_args"]
        return args[name] if name in args else EngineConfig().flat()[name]

    def create_engine_config(self, usage_context: Any = None) -> EngineConfig:
        """The validated configuration (``usage_context`` is vLLM's telemetry tag; unused)."""
        return EngineConfig.from_kwargs(**self._args)

    def __repr__(self) -> str:
        return f"AsyncEngineArgs({', '.join(f'{k}={v!r}' for k, v in self._args.items())})"


def check_request_fields(request_id: Any, prompt: Any, arrival_time: Any, priority: Any, trace_headers: Any,
                         tokenization_kwargs: Any, data_parallel_rank: Any, data_parallel_size: int
                         ) -> tuple[int, float | None]:
    """Refuse, naming the field, what the engine core could not decode or would not honour;
    return ``priority`` and ``arrival_time`` as the wire carries them."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgumentError(f"request_id must be a non-empty string, got {request_id!r} "
                                   f"({type(request_id).__name__})", "request_id")
    if isinstance(prompt, Mapping):
        for key, value in prompt.items():
            if key not in _PROMPT_KEYS and value is not None:
                raise InvalidArgumentError(
                    f"prompt of request {request_id!r}: key {key!r} is not supported (Sparrow takes text or token "
                    f"ids only: no multi-modal data, embeddings or cache salts); a prompt dict takes "
                    f"{' and '.join(_PROMPT_KEYS)}",
                    f"prompt.{key}")
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral) \
            or not _INT64_MIN <= int(priority) <= _INT64_MAX:
        raise InvalidArgumentError(f"priority of request {request_id!r} must be a 64-bit integer, got "
                                   f"{priority!r} ({type(priority).__name__})", "priority")
    if arrival_time is not None:
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real) \
                or not math.isfinite(float(arrival_time)):
            raise InvalidArgumentError(f"arrival_time of request {request_id!r} must be a finite number "
                                       f"(time.monotonic()) or None, got {arrival_time!r}", "arrival_time")
        arrival_time = float(arrival_time)
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
        if size > 1:
            raise InvalidArgumentError(f"data_parallel_rank of request {request_id!r}: Sparrow routes requests "
                                       "to its data-parallel engines itself; leave data_parallel_rank None",
                                       "data_parallel_rank")
    return int(priority), arrival_time
