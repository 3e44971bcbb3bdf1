"""LLMEngine: the synchronous frontend (input processor -> engine core client -> output processor)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sparrow.config import EngineConfig
from sparrow.core.kv_cache_utils import request_capacity_tokens
from sparrow.engine.async_inputs import check_kv_capacity, check_request_fields
from sparrow.engine.input_processor import PromptType
from sparrow.engine.iteration_stats import IterationStats, RequestStatsTracker
from sparrow.engine.messages import EngineCoreOutput, SchedulerStats
from sparrow.engine.metrics import EngineMetrics
from sparrow.engine.pooling_io import request_kind
from sparrow.engine.setup import build_frontend, finalize_config
from sparrow.engine.sleep_args import check_sleep, check_wake_up_tags
from sparrow.engine.stat_loggers import StatLoggerManager, build_stat_loggers, resolve_stat_loggers
from sparrow.engine.stats_log import LoggingStatLogger
from sparrow.errors import InvalidArgumentError, error_from_engine
from sparrow.executor import rpc
from sparrow.outputs import RequestOutput
from sparrow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sparrow.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)


def make_engine_client(config: EngineConfig, multiprocess: bool | None = None) -> Any:
    """The engine-core client: data-parallel router, multiprocess (default) or in-process
    (``SPARROW_ENABLE_MULTIPROCESSING=0``), decided in one place (``mp_client.make_client``)."""
    if config.parallel.data_parallel_size > 1:
        from sparrow.engine.dp_client import DPClient

        return DPClient(config, multiprocess=multiprocess)
    from sparrow.engine.mp_client import make_client

    return make_client(config, multiprocess)


class LLMEngine:
    """vLLM's ``LLMEngine``: ``add_request`` then ``step()`` until ``has_unfinished_requests()``
    is False. Built from an ``EngineConfig``, or as in vLLM with ``from_engine_args(EngineArgs(...))``."""

    def __init__(self, config: EngineConfig, multiprocess: bool | None = None,
                 stat_loggers: list[Any] | None = None) -> None:
        self.config = finalize_config(config)
        observability = self.config.observability
        # Custom stat loggers: looked up now, so a wrong one fails before the engine starts.
        factories = resolve_stat_loggers([*(observability.stat_loggers or []), *(stat_loggers or [])])
        frontend = build_frontend(self.config)
        self.tokenizer, self.hf_config = frontend.tokenizer, frontend.hf_config
        self.input_processor = frontend.input_processor
        self.output_processor = frontend.output_processor
        # What a request's unset sampling parameters default to (the model's generation config).
        self.default_sampling_params = frontend.default_sampling_params
        self.engine_core = make_engine_client(self.config, multiprocess)
        kv_info = self.engine_core.call_utility("get_kv_cache_info")
        self.kv_cache_capacity_tokens = request_capacity_tokens(
            kv_info["num_blocks"], kv_info["block_size"], self.hf_config, self.config.model.max_model_len or 0)
        self.last_stats: SchedulerStats | None = None
        # vLLM's periodic stats line and the Prometheus metrics the server exposes (read by
        # get_metrics()): only with disable_log_stats=False (as vLLM's LLM); custom stat loggers
        # whenever given.
        self.stat_logger: LoggingStatLogger | None = None
        self.metrics: EngineMetrics | None = None
        loggers: list[Any] = []
        if observability.disable_log_stats is False:
            self.stat_logger = LoggingStatLogger(observability.log_stats_interval,
                                                 num_engines=self.config.parallel.data_parallel_size)
            self.metrics = EngineMetrics(self.config.model.served_model_name or "sparrow-tiny")
            loggers += [self.stat_logger, self.metrics]
        try:
            loggers += build_stat_loggers(factories, self.config)
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.stat_loggers = StatLoggerManager(loggers, observability.log_stats_interval)
        self.stat_loggers.log_engine_initialized()
        # Per engine-core request, while any logger is on: arrival, first and last token times.
        self._request_stats = RequestStatsTracker()
        # Outputs of a step that also raised (another request failed): handed out by the next step.
        self._held_outputs: list[RequestOutput] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: Any = None, stat_loggers: list[Any] | None = None,
                         enable_multiprocessing: bool | None = None) -> LLMEngine:
        """vLLM's constructor. ``usage_context`` is vLLM's telemetry tag (unused); ``stat_loggers``
        are vLLM's custom stat loggers (``sparrow.engine.stat_loggers``); ``enable_multiprocessing``
        None: the engine core in its own process unless ``SPARROW_ENABLE_MULTIPROCESSING=0``."""
        if not callable(getattr(engine_args, "create_engine_config", None)):
            raise TypeError(f"LLMEngine.from_engine_args: engine_args must be an EngineArgs, got "
                            f"{type(engine_args).__name__}")
        return cls(engine_args.create_engine_config(), multiprocess=enable_multiprocessing, stat_loggers=stat_loggers)

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, usage_context: Any = None,
                         stat_loggers: list[Any] | None = None) -> LLMEngine:
        """vLLM's name for building from a whole configuration (here an ``EngineConfig``, whose
        ``disable_log_stats`` decides the stats line)."""
        return cls(vllm_config, stat_loggers=stat_loggers)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- requests ---------------------------------------------------------------------------
    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                        lora_request: Any = None, default_max_tokens: bool = False,
                        arrival_time: float | None = None, pooling_params: Any = None):
        """Validate and tokenize; raises ValueError naming the prompt (or ``lora_request``).
        Touches no engine state. ``pooling_params``: a pooling model's request (resolved by
        ``input_processor.pooling``; ``params`` then carry the prompt only)."""
        if lora_request is not None:
            from sparrow.lora.engine import check_lora_request

            check_lora_request(lora_request, self.config, self.hf_config)
        text, request = self.input_processor.process_inputs(request_id, prompt, params, priority=priority,
                                                            arrival_time=arrival_time, lora_request=lora_request,
                                                            default_max_tokens=default_max_tokens,
                                                            pooling_params=pooling_params)
        check_kv_capacity(request, self.kv_cache_capacity_tokens, self.config.model.max_model_len or 0)
        return text, request

    def add_processed_request(self, text: str | None, request: Any) -> None:
        """Register and send a request from ``process_request``. All or nothing: if sending fails,
        nothing of the request stays registered (the exception is raised)."""
        children = self.output_processor.add_request(request, text)
        try:
            for child in children:
                if self.stat_loggers:
                    self._request_stats.add_request(child.request_id, child.arrival_time,
                                                    len(child.prompt_token_ids), child.sampling_params.max_tokens)
                self.engine_core.add_request(child)
        except BaseException:
            self._abort_quietly([request.request_id])
            raise

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: Any = None,
                    tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Mapping[str, str] | None = None,
                    priority: int = 0) -> None:
        """vLLM's ``LLMEngine.add_request``: validate, tokenize and submit; its outputs come from
        ``step()``. ``params=None`` takes the model's generation-config defaults; ``params`` are
        ``PoolingParams`` for a pooling model (runner="pooling"). Raises ValueError
        naming the field; ``trace_headers`` and ``tokenization_kwargs`` are refused unless empty."""
        priority, arrival_time = check_request_fields(request_id, prompt, arrival_time, priority, trace_headers,
                                                      tokenization_kwargs, None, 1)
        params, defaults, pooling_params = request_kind(self.input_processor, request_id, params,
                                                        self.default_sampling_params, "params")
        text, request = self.process_request(request_id, prompt, params, priority, lora_request,
                                             default_max_tokens=defaults, arrival_time=arrival_time,
                                             pooling_params=pooling_params)
        self.add_processed_request(text, request)

    def abort_request(self, request_ids: list[str] | str) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = set(request_ids)
        self._held_outputs = [o for o in self._held_outputs if o.request_id not in aborted]
        engine_ids = self.output_processor.abort_requests(request_ids)
        if self.stat_loggers and engine_ids:
            aborted_stats = IterationStats()
            for engine_id in engine_ids:
                self._request_stats.finish(aborted_stats, engine_id, "abort")
            self.stat_loggers.record(None, aborted_stats)
        self.engine_core.abort_requests(engine_ids)

    def _abort_quietly(self, request_ids: list[str]) -> None:
        """Abort while already failing: the frontend forgets them even if the core is gone."""
        try:
            self.abort_request(request_ids)
        except Exception:  # noqa: BLE001 - the frontend side is clean; the core may be dead
            logger.debug("abort of %s could not reach the engine core", request_ids, exc_info=True)

    def has_unfinished_requests(self) -> bool:
        # Held outputs count: the request they finish is already forgotten by the processor.
        return bool(self._held_outputs) or self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One batch of outputs ([] at once when no request is unfinished). Raises ValueError when
        the engine core failed a request (its error finish); that request and its n > 1 siblings
        are then gone, and the outputs the other requests got in the same batch come with the
        next call."""
        if self._held_outputs:
            held, self._held_outputs = self._held_outputs, []
            return held
        if not self.output_processor.has_unfinished_requests():
            return []  # nothing to wait for (a loop calling step() on an idle engine must not block)
        outputs = self.engine_core.get_output()
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
        stats = IterationStats() if self.stat_loggers else None
        if stats is not None:
            self._request_stats.update_from_outputs(stats, outputs.outputs, time.monotonic())
        failures: dict[str, EngineCoreOutput] = {}  # caller's request id -> the engine core's error finish
        core_outputs = []
        for output in outputs.outputs:
            if output.error_message is None:
                core_outputs.append(output)
                continue
            if stats is not None:
                self._request_stats.finish(stats, output.request_id, "error")
            external_id = self.output_processor.external_id_of(output.request_id)
            if external_id is not None:  # else: already aborted by its caller; nobody waits
                failures.setdefault(external_id, output)
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.reqs_to_abort:
            if stats is not None:  # stopped here, by a stop string
                for engine_id in processed.reqs_to_abort:
                    self._request_stats.finish(stats, engine_id, "stop")
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if stats is not None:
            self.stat_loggers.record(outputs.scheduler_stats, stats if outputs.outputs else None)
            self.stat_loggers.maybe_log()
        if failures:
            self.abort_request(list(failures))
            self._held_outputs = [o for o in processed.request_outputs if o.request_id not in failures]
            if len(failures) == 1:  # the common case keeps the engine core's field
                (rid, failed), = failures.items()
                raise error_from_engine(f"request {rid!r}: {failed.error_message or ''}", failed.error_field)
            raise ValueError("; ".join(f"request {rid!r}: {failed.error_message}" for rid, failed in failures.items()))
        return processed.request_outputs

    # -- utilities --------------------------------------------------------------------------
    def get_metrics(self) -> list[Any]:
        """vLLM's: the engine's metrics (``sparrow.engine.metrics_reader``: Counter, Gauge, Vector,
        Histogram), the ones the server exposes at /metrics; needs ``disable_log_stats=False``."""
        if self.metrics is None:
            raise InvalidArgumentError("get_metrics: the engine keeps no statistics; build it with "
                                       "disable_log_stats=False", "disable_log_stats")
        from sparrow.engine.metrics_reader import snapshot

        return snapshot(self.metrics.registry)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.call_utility("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        """vLLM's: release the KV cache (discarded) and the weights (level 1: offloaded to host
        memory; level 2: discarded) while no request runs; needs ``enable_sleep_mode=True``."""
        check_sleep(self.config, level)
        self.engine_core.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: take back the memory of ``tags`` ("weights", "kv_cache"; default both)."""
        self.engine_core.call_utility("wake_up", check_wake_up_tags(tags))

    def is_sleeping(self) -> bool:
        return self.engine_core.call_utility("is_sleeping")

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: ``worker.method(*args, **kwargs)`` on every worker, or ``method(worker, *args,
        **kwargs)`` for a function (sent pickled, so a lambda works; its result comes back as any
        Python value); results in rank order. ``timeout``: seconds before a TimeoutError."""
        results = self.engine_core.call_utility("collective_rpc", *rpc.utility_args(method, timeout, args, kwargs))
        return rpc.load_results(method, results)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: ``func(model)`` on every worker's model (a ``torch.nn.Module``); results in rank order."""
        return self.collective_rpc(functools.partial(rpc.call_on_model, func))

    def start_profile(self) -> None:
        self.engine_core.call_utility("profile", True)

    def stop_profile(self) -> list[dict[str, Any]]:
        return self.engine_core.call_utility("profile", False)

    # -- LoRA adapters (vLLM's names) -------------------------------------------------------
    def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter into the workers ahead of its first request."""
        from sparrow.lora.engine import check_lora_request

        check_lora_request(lora_request, self.config, self.hf_config)
        return self.engine_core.call_utility("add_lora", lora_request.lora_name, lora_request.lora_int_id,
                                             lora_request.lora_path)

    def remove_lora(self, lora_id: int) -> bool:
        """Drop an adapter from the workers (a later request with it loads it again)."""
        return self.engine_core.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded in the workers."""
        return set(self.engine_core.call_utility("list_loras"))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
