"""``AsyncLLM``'s utility calls (vLLM's names): configuration getters, calls that go to the
engine core and back (prefix cache, profiler, stats, LoRA adapters, ``collective_rpc``), and
``beam_search`` (sparrow.engine.async_beam_search).

A mixin: the host class (``sparrow.engine.async_llm.AsyncLLM``) provides ``config``,
``model_config``, ``hf_config``, ``tokenizer``, ``engine_core``, ``stat_loggers``, ``run_input_work`` and
the liveness checks ``_raise_if_dead`` / ``_bind_loop``. A call to a dead engine raises
``EngineDeadError``; a call from another event loop a ``RuntimeError``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import AsyncGenerator, Callable
from typing import Any

from sparrow.config import EngineConfig
from sparrow.engine.messages import SchedulerStats
from sparrow.engine.sleep_args import check_sleep, check_wake_up_tags
from sparrow.errors import InvalidArgumentError
from sparrow.executor import rpc
from sparrow.lora.engine import check_lora_request
from sparrow.outputs import RequestOutput


class AsyncEngineUtilities:
    config: EngineConfig
    model_config: Any
    hf_config: Any
    tokenizer: Any
    engine_core: Any
    output_processor: Any
    stat_loggers: Any

    # Provided by the host class.
    def _raise_if_dead(self) -> None:
        raise NotImplementedError

    def _bind_loop(self) -> None:
        raise NotImplementedError

    async def run_input_work(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    # -- configuration ----------------------------------------------------------------------
    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def get_model_config(self) -> Any:
        return self.model_config

    async def get_vllm_config(self) -> EngineConfig:
        return self.config

    async def get_supported_tasks(self) -> tuple[str, ...]:
        # vLLM's task names, the default first: an embedding model's ("embed", "token_embed") or a
        # classifier's ("classify", "score" for a cross-encoder, "token_classify").
        pooling = self.input_processor.pooling
        return ("generate",) if pooling is None else pooling.supported_tasks

    async def is_tracing_enabled(self) -> bool:
        return False

    # -- beam search ------------------------------------------------------------------------
    def beam_search(self, prompt: Any, request_id: str, params: Any, lora_request: Any = None, *,
                    priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's ``EngineClient.beam_search``: an async generator of one final ``RequestOutput``
        whose ``outputs`` are the ``params.beam_width`` best beams (a ``BeamSearchParams``), best
        first. See sparrow.engine.async_beam_search."""
        from sparrow.engine.async_beam_search import async_beam_search

        return async_beam_search(self, prompt, request_id, params, lora_request,  # type: ignore[arg-type]
                                 priority=priority)

    # -- engine-core calls -------------------------------------------------------------------
    async def _call_utility(self, method: str, *args: Any) -> Any:
        self._raise_if_dead()
        self._bind_loop()
        return await self.engine_core.call_utility_async(method, *args)

    async def reset_prefix_cache(self) -> bool:
        return await self._call_utility("reset_prefix_cache")

    async def start_profile(self) -> None:
        await self._call_utility("profile", True)

    async def stop_profile(self) -> list[dict[str, Any]]:
        return await self._call_utility("profile", False)

    async def get_scheduler_stats(self) -> SchedulerStats:
        stats = await self._call_utility("get_scheduler_stats")
        # A snapshot of cumulative counters: the loggers take what is new in it.
        self.stat_loggers.record(stats, None)
        return stats

    async def get_kv_cache_info(self) -> dict[str, int]:
        return await self._call_utility("get_kv_cache_info")

    async def sleep(self, level: int = 1) -> None:
        """vLLM's (see ``LLMEngine.sleep``)."""
        check_sleep(self.config, level)
        await self._call_utility("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call_utility("wake_up", check_wake_up_tags(tags))

    async def is_sleeping(self) -> bool:
        return await self._call_utility("is_sleeping")

    async def pause_generation(self, *, mode: str = "abort", wait_for_inflight_requests: bool | None = None,
                               clear_cache: bool = True) -> None:
        """vLLM's: pause the engine for a weight update; requests added meanwhile wait for
        ``resume_generation``. ``mode``: ``"abort"`` ends every unfinished request now (finish
        reason ``"abort"``), ``"wait"`` returns once they have all finished, ``"keep"`` freezes
        them where they are until resume. ``clear_cache``: drop the prefix cache (for keep, the
        frozen requests recompute their KV after resume). ``wait_for_inflight_requests=True`` is
        vLLM's older ``mode="wait"``. Returns once the unfinished requests' streams have ended
        (abort, wait). See sparrow.engine.core_pause."""
        from sparrow.engine.core_pause import check_pause_mode

        if wait_for_inflight_requests:
            warnings.warn("pause_generation(wait_for_inflight_requests=True) is vLLM's older form of "
                          "mode='wait'", DeprecationWarning, stacklevel=2)
            mode = "wait"
        check_pause_mode(mode)
        if not isinstance(clear_cache, bool):
            raise InvalidArgumentError(f"clear_cache must be True or False, got {clear_cache!r}", "clear_cache")
        unfinished = self.output_processor.unfinished_request_ids()
        await self._call_utility("pause_scheduler", mode, clear_cache and mode != "wait")
        if mode != "keep":  # their last outputs (the aborts, or the ends of the drained requests)
            await self._wait_until_delivered(unfinished)
        if mode == "wait" and clear_cache:
            await self._call_utility("reset_prefix_cache")

    async def resume_generation(self) -> None:
        """vLLM's: undo ``pause_generation``; the requests that waited are scheduled, in order."""
        await self._call_utility("resume_scheduler")

    async def is_paused(self) -> bool:
        return await self._call_utility("is_scheduler_paused")

    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                             args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's (see ``LLMEngine.collective_rpc``): a worker method's name, or a function of the worker."""
        results = await self._call_utility("collective_rpc", *rpc.utility_args(method, timeout, args, kwargs))
        return rpc.load_results(method, results)

    async def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` on every worker's model; results in rank order."""
        return await self.collective_rpc(functools.partial(rpc.call_on_model, func))

    # LoRA adapters (vLLM's names): load ahead of use, forget, list the loaded ids.
    async def add_lora(self, lora_request: Any) -> bool:
        if lora_request is None:
            raise InvalidArgumentError("add_lora: lora_request must be a LoRARequest, got None", "lora_request")
        await self.run_input_work(check_lora_request, lora_request, self.config, self.hf_config)
        return await self._call_utility(
            "add_lora", lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call_utility("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return set(await self._call_utility("list_loras"))
