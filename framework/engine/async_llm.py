"""AsyncLLM: the asyncio frontend (vLLM's ``AsyncLLM``), used by the OpenAI-compatible server.

    generate() -> InputProcessor -> OutputProcessor.add_request -> AsyncMPClient -> engine core
    output handler task: engine core outputs -> OutputProcessor -> per-request collectors
                         -> generate() yields RequestOutputs to its consumer
                         (sparrow.engine.async_output)

The engine core always runs in its own process here (an in-process core would block the event
loop during every forward pass). A consumer that stops early (its task is cancelled, or it
closes the generator) aborts the request in the engine core, which frees its KV blocks.
When the engine core dies, every pending and later call raises ``EngineDeadError``.

Tokenizing a prompt (and validating it) runs on one worker thread, not on the event loop: a
prompt of megabytes takes seconds to tokenize, and the loop must keep serving open streams and
health checks meanwhile.

An AsyncLLM belongs to the event loop of its first request or utility call; another loop (a second
``asyncio.run``, another thread) gets a RuntimeError saying so.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sparrow.config import EngineConfig
from sparrow.core.kv_cache_utils import request_capacity_tokens
from sparrow.engine.async_inputs import AsyncEngineArgs, check_kv_capacity, check_request_fields
from sparrow.engine.async_output import AsyncOutputHandling
from sparrow.engine.async_utilities import AsyncEngineUtilities
from sparrow.engine.exceptions import EngineDeadError
from sparrow.engine.input_processor import PromptType
from sparrow.engine.iteration_stats import RequestStatsTracker
from sparrow.engine.messages import SchedulerStats
from sparrow.engine.metrics import EngineMetrics
from sparrow.engine.mp_client import AsyncMPClient
from sparrow.engine.output_collector import RequestOutputCollector
from sparrow.engine.pooling_io import request_kind, with_truncation
from sparrow.engine.setup import build_frontend, finalize_config
from sparrow.engine.stat_loggers import StatLoggerManager, build_stat_loggers, resolve_stat_loggers
from sparrow.engine.stats_log import LoggingStatLogger
from sparrow.errors import InvalidArgumentError
from sparrow.lora.engine import check_lora_request
from sparrow.outputs import PoolingRequestOutput, RequestOutput
from sparrow.pooling_params import PoolingParams
from sparrow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

class AsyncLLM(AsyncOutputHandling, AsyncEngineUtilities):
    """An asyncio engine. ``AsyncLLM.from_engine_args(model=..., max_model_len=...)`` takes the
    same keywords as ``LLM`` (or, as in vLLM, one ``AsyncEngineArgs``); ``AsyncLLM(config)`` and
    ``AsyncLLM.from_vllm_config(config)`` take an ``EngineConfig``. ``executor_factory``
    ("package.module:callable") replaces the configured executor in the engine process (tests).
    ``stat_loggers``: vLLM's custom stat loggers (``StatLoggerBase`` subclasses or factories, see
    ``sparrow.engine.stat_loggers``), added to those the ``stat_loggers`` engine argument names."""

    def __init__(self, config: EngineConfig, *, executor_factory: str | None = None,
                 stat_loggers: list[Any] | None = None) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"AsyncLLM(config) takes an EngineConfig, got {type(config).__name__}; for engine "
                            "arguments use AsyncLLM.from_engine_args(model=..., ...)")
        self.config = finalize_config(config)
        model_dir = self.config.model.model
        self.model_config = self.config.model
        self.served_model_name = self.config.model.served_model_name or model_dir
        frontend = build_frontend(self.config)
        self.tokenizer, self.hf_config = frontend.tokenizer, frontend.hf_config
        self.input_processor = frontend.input_processor
        self.output_processor = frontend.output_processor
        # What a request's unset sampling parameters default to (the model's generation config).
        self.default_sampling_params = frontend.default_sampling_params
        self.metrics = EngineMetrics(self.served_model_name)
        self.last_stats: SchedulerStats | None = None
        # vLLM's periodic stats line (on unless disable_log_stats is True), fed by the output handler.
        observability = self.config.observability
        self.stat_logger: LoggingStatLogger | None = None
        if observability.disable_log_stats is not True:
            self.stat_logger = LoggingStatLogger(observability.log_stats_interval,
                                                 num_engines=self.config.parallel.data_parallel_size)
        # Custom loggers: named ones are looked up now, so a wrong name fails before the engine starts.
        custom_factories = resolve_stat_loggers([*(observability.stat_loggers or []), *(stat_loggers or [])])
        # Per engine-core request: arrival, first and last token times (for TTFT, ITL, e2e).
        self._request_stats = RequestStatsTracker()
        # request_id -> the mailbox of its generate() consumer
        self._collectors: dict[str, RequestOutputCollector] = {}
        # engine-core request id -> caller's request id (they differ for the children of n > 1)
        self._external_ids: dict[str, str] = {}
        self._dead_error: EngineDeadError | None = None
        self._dead_event = asyncio.Event()
        self._outputs_delivered = asyncio.Event()  # set after every batch of outputs and abort
        self._output_handler: asyncio.Task | None = None
        # The event loop this engine belongs to: that of its first request or utility call.
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set by shutdown(): prompts still queued for the input thread then fail with the dead error.
        self._closed = False
        # One thread, as vLLM has: a Hugging Face fast tokenizer re-configured (truncation,
        # padding) by one thread while another encodes fails with "Already borrowed".
        self._input_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparrow-input")
        self.engine_core: Any
        if self.config.parallel.data_parallel_size > 1:
            from sparrow.engine.dp_client import AsyncDPClient

            self.engine_core = AsyncDPClient(self.config, executor_factory=executor_factory)
        else:
            self.engine_core = AsyncMPClient(self.config, executor_factory=executor_factory)
        kv_info = self.engine_core.kv_cache_info
        self.kv_cache_capacity_tokens = request_capacity_tokens(
            kv_info["num_blocks"], kv_info["block_size"], self.hf_config, self.model_config.max_model_len or 0)
        try:
            loggers = [self.metrics, *([self.stat_logger] if self.stat_logger else []),
                       *build_stat_loggers(custom_factories, self.config)]
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.stat_loggers = StatLoggerManager(loggers, observability.log_stats_interval)
        self.stat_loggers.log_engine_initialized()

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs | EngineConfig | None = None, /, *,
                         executor_factory: str | None = None, stat_loggers: list[Any] | None = None,
                         **kwargs: Any) -> AsyncLLM:
        """``from_engine_args(model=..., **engine_args)``, or vLLM's ``from_engine_args(AsyncEngineArgs(...))``;
        ``stat_loggers`` as in ``AsyncLLM``."""
        if engine_args is None:
            return cls(EngineConfig.from_kwargs(**kwargs), executor_factory=executor_factory, stat_loggers=stat_loggers)
        if kwargs:
            raise TypeError(f"AsyncLLM.from_engine_args: pass the engine arguments in engine_args or as keywords, "
                            f"not both (got engine_args and {', '.join(sorted(kwargs))})")
        if isinstance(engine_args, EngineConfig):
            return cls(engine_args, executor_factory=executor_factory, stat_loggers=stat_loggers)
        if not callable(getattr(engine_args, "create_engine_config", None)):
            raise TypeError(f"AsyncLLM.from_engine_args: engine_args must be an AsyncEngineArgs or an EngineConfig, "
                            f"got {type(engine_args).__name__}")
        return cls(engine_args.create_engine_config(), executor_factory=executor_factory, stat_loggers=stat_loggers)

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, *, executor_factory: str | None = None,
                         stat_loggers: list[Any] | None = None) -> AsyncLLM:
        """vLLM's name for building from a whole configuration (here an ``EngineConfig``)."""
        return cls(vllm_config, executor_factory=executor_factory, stat_loggers=stat_loggers)

    # -- state ------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead_error is not None or self.engine_core.is_dead

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error or self.engine_core.dead_error

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        return self.errored

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine core is gone."""
        self._raise_if_dead()

    def _bind_loop(self) -> None:
        """Tie the engine to the running event loop on first use; refuse any other loop."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "this AsyncLLM belongs to the event loop of its first request and cannot be used from another "
                "one (a second asyncio.run(), another thread); create the engine in, and use it from, one loop")

    def _raise_if_dead(self) -> None:
        error = self.dead_error
        if error is not None:
            raise error

    async def wait_until_dead(self) -> EngineDeadError:
        """Return once the engine core has died (or ``fail_all`` / ``shutdown`` ended the engine).
        Starts the output handler, so that a death is noticed even when no request is running."""
        self._bind_loop()
        self._ensure_output_handler()
        await self._dead_event.wait()
        return self.dead_error or EngineDeadError()

    async def run_input_work(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` (tokenizing, rendering a chat template) on the input thread and await it,
        so that the event loop stays free while a huge prompt is processed."""
        work = functools.partial(fn, *args, **kwargs)

        def run() -> T:
            # Work still queued when shutdown() came fails here, as every caller of a dead engine
            # does (a cancelled future would raise CancelledError in a task nobody cancelled).
            if self._closed:
                raise self._shutdown_error()
            return work()

        try:
            future = self._input_executor.submit(run)
        except RuntimeError:  # the executor was shut down with the engine
            raise self._shutdown_error() from None
        return await asyncio.wrap_future(future)

    def _shutdown_error(self) -> EngineDeadError:
        return self.dead_error or EngineDeadError("the engine was shut down")

    # -- requests ---------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as they come (per ``sampling_params.output_kind``).

        Raises ValueError naming the field for an invalid request (before anything is yielded) and
        EngineDeadError when the engine dies or is shut down. Closing or cancelling the consumer
        aborts it. vLLM's ``data_parallel_rank`` picks the data-parallel engine that runs the
        request (a KV-aware router's choice); ``trace_headers`` and ``tokenization_kwargs`` are
        accepted when they ask for nothing (None or empty) and refused otherwise.
        """
        if self.input_processor.pooling is not None:  # None would otherwise mean pooling's defaults
            raise InvalidArgumentError(f"request {request_id!r}: this engine runs a pooling (embedding) model "
                                       "(runner='pooling'): use encode(), not generate()", "sampling_params")
        collector = await self.add_request(request_id, prompt, sampling_params, priority=priority,
                                           lora_request=lora_request, trace_headers=trace_headers,
                                           data_parallel_rank=data_parallel_rank,
                                           tokenization_kwargs=tokenization_kwargs)
        stream = self.stream_outputs(request_id, collector)
        try:
            async for output in stream:
                yield output
        finally:
            # Closing an unfinished stream aborts the request in the engine core.
            await stream.aclose()

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """vLLM's pooling entry point (an engine with runner="pooling"): yields one
        ``PoolingRequestOutput``, the prompt's vector in ``outputs.data``. ``truncate_prompt_tokens``
        (vLLM's older place for it) goes into the pooling parameters. Errors as in ``generate``."""
        params = with_truncation(request_id, pooling_params, truncate_prompt_tokens)
        collector = await self.add_request(request_id, prompt, params, priority=priority, lora_request=lora_request,
                                           trace_headers=trace_headers, tokenization_kwargs=tokenization_kwargs)
        stream = self.stream_outputs(request_id, collector)
        try:
            async for output in stream:
                yield output  # type: ignore[misc]
        finally:
            await stream.aclose()

    async def stream_outputs(self, request_id: str, collector: RequestOutputCollector
                             ) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of a request submitted with ``add_request``, until it finishes. For
        servers that validate (``add_request``) before they commit to a response."""
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                logger.debug("request %s: consumer went away; aborting it", request_id)
                self._abort_now([request_id])
            raise
        finally:
            self._collectors.pop(request_id, None)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                          arrival_time: float | None = None, lora_request: Any = None,
                          tokenization_kwargs: dict[str, Any] | None = None,
                          trace_headers: Mapping[str, str] | None = None, priority: int = 0,
                          data_parallel_rank: int | None = None) -> RequestOutputCollector:
        """Validate and submit a request; its outputs go to the returned collector (vLLM's
        parameters; see ``generate``)."""
        self._raise_if_dead()
        self._bind_loop()
        self._ensure_output_handler()
        priority, arrival_time = check_request_fields(
            request_id, prompt, arrival_time, priority, trace_headers, tokenization_kwargs, data_parallel_rank,
            self.config.parallel.data_parallel_size)
        self._check_request_id_free(request_id)
        params, defaults, pooling_params = request_kind(self.input_processor, request_id, params,
                                                        self.default_sampling_params, "sampling_params")
        if lora_request is not None:  # reads the adapter's config and tensor header
            await self.run_input_work(check_lora_request, lora_request, self.config, self.hf_config)
        text, request = await self.run_input_work(
            self.input_processor.process_inputs, request_id, prompt, params, priority=priority,
            arrival_time=arrival_time, lora_request=lora_request, default_max_tokens=defaults,
            pooling_params=pooling_params)
        # While the prompt was processed the engine may have died, or another caller taken the id.
        self._raise_if_dead()
        self._check_request_id_free(request_id)
        check_kv_capacity(request, self.kv_cache_capacity_tokens, self.model_config.max_model_len or 0)
        if data_parallel_rank is not None:  # vLLM's: the engine that runs it (checked above)
            request.data_parallel_rank = int(data_parallel_rank)
        collector = RequestOutputCollector(params.output_kind)
        children = self.output_processor.add_request(request, text, queue=collector)
        self._collectors[request_id] = collector
        for child in children:
            self._external_ids[child.request_id] = request_id
            self._request_stats.add_request(child.request_id, child.arrival_time, len(child.prompt_token_ids),
                                            child.sampling_params.max_tokens)
        try:
            for child in children:
                await self.engine_core.add_request_async(child)
        except BaseException:
            self._abort_now([request_id])
            self._collectors.pop(request_id, None)
            raise
        return collector

    def _check_request_id_free(self, request_id: str) -> None:
        if request_id in self._collectors:
            raise InvalidArgumentError(f"request_id {request_id!r} is already in use by an unfinished request",
                                       "request_id")

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (ids of unfinished requests; others are ignored, as in vLLM): their
        consumers get a final output with finish_reason "abort"."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for item in request_ids:
            if not isinstance(item, str):
                raise InvalidArgumentError(f"abort: request ids are strings, got {item!r} ({type(item).__name__})",
                                           "request_id")
        self._abort_now(request_ids)

    def fail_all(self, error: EngineDeadError) -> int:
        """Refuse every later request and end every unfinished one with ``error``, aborting its
        work in the engine core (a server that shuts down). Returns how many were ended."""
        request_ids = list(self._collectors)
        self._abort_now(request_ids)
        self._set_dead(error)
        return len(request_ids)

    def _abort_now(self, request_ids: list[str]) -> None:
        engine_ids = self.output_processor.abort_requests(request_ids)
        self._outputs_delivered.set()
        for engine_id in engine_ids:
            self._engine_request_done(engine_id, "abort")
        if engine_ids and not self.errored:
            try:
                self.engine_core.abort_requests(engine_ids)
            except EngineDeadError:
                pass  # nothing left to free

    def shutdown(self) -> None:
        """Stop the engine process; pending consumers get EngineDeadError."""
        self._closed = True
        self.engine_core.shutdown()
        # A prompt being tokenized finishes on its own; those queued behind it fail at once.
        self._input_executor.shutdown(wait=False)
        error = self._shutdown_error()
        handler = self._output_handler
        if handler is None or handler.done():
            return

        def stop() -> None:
            self._set_dead(error)
            handler.cancel()

        loop = handler.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is loop:
                stop()
            else:
                loop.call_soon_threadsafe(stop)
        except RuntimeError:
            pass  # the loop is closed; the task died with it
