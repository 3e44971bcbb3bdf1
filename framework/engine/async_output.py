"""``AsyncLLM``'s output side: the task that reads the engine core's outputs, turns them into
``RequestOutput``s for each request's collector, records metrics and the periodic stats line,
raises the engine core's rejections to their consumers, and fails every consumer when the engine
dies.

A mixin: the host class (``sparrow.engine.async_llm.AsyncLLM``) provides the attributes below and
``_abort_now``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from sparrow.engine.exceptions import EngineDeadError
from sparrow.engine.iteration_stats import IterationStats, RequestStatsTracker
from sparrow.engine.messages import EngineCoreOutput, SchedulerStats
from sparrow.engine.stat_loggers import StatLoggerManager
from sparrow.errors import error_from_engine

logger = logging.getLogger(__name__)


class AsyncOutputHandling:
    engine_core: Any
    output_processor: Any
    metrics: Any
    stat_logger: Any
    stat_loggers: StatLoggerManager
    last_stats: SchedulerStats | None
    _collectors: dict[str, Any]
    _external_ids: dict[str, str]
    _request_stats: RequestStatsTracker
    _output_handler: asyncio.Task | None
    _dead_error: EngineDeadError | None
    _dead_event: asyncio.Event
    _outputs_delivered: asyncio.Event

    # Provided by the host class.
    def _abort_now(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def _raise_if_dead(self) -> None:
        raise NotImplementedError

    def _engine_request_done(self, engine_id: str, finish_reason: str, stats: IterationStats | None = None) -> None:
        """Forget an engine-core request; its figures go into ``stats`` (a batch being recorded),
        or, finished between batches (an abort), to the loggers at once."""
        if stats is not None:
            self._request_stats.finish(stats, engine_id, finish_reason)
        else:
            alone = IterationStats()
            self._request_stats.finish(alone, engine_id, finish_reason)
            if alone.finished_requests:
                self.stat_loggers.record(None, alone)
        self._external_ids.pop(engine_id, None)

    # -- the output handler -----------------------------------------------------------------
    def _ensure_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="AsyncLLM.output_handler")

    async def _run_output_handler(self) -> None:
        # The loggers' first interval starts with the first request; a line also comes while no
        # output arrives (an engine gone idle). The task ends with this one (shutdown cancels it).
        now = time.monotonic()
        self.stat_loggers.start(now)
        if self.stat_logger is not None:
            self.stat_logger.start(now)
        stats_task = asyncio.get_running_loop().create_task(
            self._log_stats_periodically(self.stat_loggers), name="AsyncLLM.stats_logger")
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                now = time.monotonic()
                if outputs.scheduler_stats is not None:
                    self.last_stats = outputs.scheduler_stats
                iteration = IterationStats()
                if outputs.outputs:
                    self._process_outputs(outputs.outputs, now, iteration)
                self.stat_loggers.record(outputs.scheduler_stats, iteration if outputs.outputs else None)
        except EngineDeadError as exc:
            self._set_dead(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken handler must fail callers, not hang them
            logger.exception("AsyncLLM output handler failed")
            self._set_dead(EngineDeadError(f"the output handler failed: {type(exc).__name__}: {exc}"))
        finally:
            stats_task.cancel()

    @staticmethod
    async def _log_stats_periodically(stat_loggers: StatLoggerManager) -> None:
        while True:
            await asyncio.sleep(stat_loggers.seconds_until_due(time.monotonic()))
            stat_loggers.maybe_log(time.monotonic())

    async def _wait_until_delivered(self, request_ids: set[str]) -> None:
        """Return once each of these engine-core requests has had its final output delivered
        (the output processor has forgotten it); raise if the engine dies meanwhile."""
        while request_ids & self.output_processor.unfinished_request_ids():
            self._raise_if_dead()
            self._outputs_delivered.clear()
            await self._outputs_delivered.wait()  # set by every batch, abort and death

    def _process_outputs(self, core_outputs: list[EngineCoreOutput], now: float, stats: IterationStats) -> None:
        self._outputs_delivered.set()
        if any(output.error_message is not None for output in core_outputs):
            core_outputs = self._fail_rejected(core_outputs, stats)
        self._request_stats.update_from_outputs(stats, core_outputs, now)
        processed = self.output_processor.process_outputs(core_outputs, now)
        for output in core_outputs:
            if output.finish_reason is not None:
                self._external_ids.pop(output.request_id, None)  # its figures are in stats already
        if processed.reqs_to_abort:
            # Stop strings are found here, not in the engine core: tell it to stop generating.
            for engine_id in processed.reqs_to_abort:
                self._engine_request_done(engine_id, "stop", stats)
            self.engine_core.abort_requests(processed.reqs_to_abort)

    def _fail_rejected(self, core_outputs: list[EngineCoreOutput], stats: IterationStats) -> list[EngineCoreOutput]:
        """Raise the engine core's rejection to the request's consumer; drop those outputs."""
        kept = []
        for output in core_outputs:
            if output.error_message is None:
                kept.append(output)
                continue
            external_id = self._external_ids.get(output.request_id)
            collector = self._collectors.get(external_id) if external_id is not None else None
            if collector is not None:
                collector.put(error_from_engine(output.error_message, output.error_field))
            self._engine_request_done(output.request_id, "error", stats)
            if external_id is not None:
                # The other samples of an n > 1 request cannot complete it any more.
                self._abort_now([external_id])
        return kept

    def _set_dead(self, error: EngineDeadError) -> None:
        if self._dead_error is None:
            self._dead_error = error
        for collector in self._collectors.values():
            collector.put(error)
        self._dead_event.set()
        self._outputs_delivered.set()
