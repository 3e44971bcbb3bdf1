"""Stat loggers: vLLM's ``StatLoggerBase`` interface, and the manager that feeds every logger.

A frontend (``AsyncLLM``, ``LLMEngine``) measures each batch of engine-core outputs once
(``iteration_stats``) and hands the same figures to each logger: the periodic stats line
(``stats_log.LoggingStatLogger``), the Prometheus metrics (``metrics.EngineMetrics``) and any
custom logger a user or a plugin supplies. A custom logger is, as in vLLM, a subclass of
``StatLoggerBase`` (or any factory) called as ``factory(engine_config, engine_index)``; name one
with the ``stat_loggers`` engine argument (a name registered by a plugin through
``sparrow_register_stat_loggers``, or ``package.module:Class``), or pass the classes to
``AsyncLLM(..., stat_loggers=[...])`` / ``LLMEngine.from_engine_args(..., stat_loggers=[...])``.

What a logger's ``record`` receives: ``scheduler_stats`` with the gauges of the latest snapshot
and its counters (prefix-cache queries and hits, preemptions, speculative decoding) as the growth
since the snapshot before, so a logger adds them up without seeing an event twice; and the batch's
``IterationStats``. Either may be None. With data parallelism the engines' snapshots arrive summed
and ``engine_idx`` is 0. Loggers run in the frontend process, on the thread or event loop that
reads outputs: ``record`` must be quick. A logger that raises is logged once and dropped; the
engine and the other loggers go on.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from sparrow.engine.iteration_stats import IterationStats
from sparrow.engine.stats_deltas import SchedulerStatsDeltas
from sparrow.errors import InvalidArgumentError
from sparrow.wire import SchedulerStats

logger = logging.getLogger(__name__)


class StatLoggerBase(ABC):
    """vLLM's interface for a custom stat logger (``SchedulerStats`` and ``IterationStats`` are
    Sparrow's, with vLLM's field names where vLLM has the figure)."""

    @abstractmethod
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None: ...

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        """One batch of outputs and/or one scheduler snapshot."""

    @abstractmethod
    def log_engine_initialized(self) -> None:
        """Called once, when the engine is up (the KV cache is sized)."""

    def log(self) -> None:  # noqa: B027 - optional, as in vLLM
        """Called every ``log_stats_interval`` seconds."""


StatLoggerFactory = Callable[[Any, int], StatLoggerBase]


def resolve_stat_logger(item: Any, registry: Any) -> StatLoggerFactory:
    """A ``stat_loggers`` entry -> its factory: a registered name, ``package.module:Class``, or a
    class / callable. InvalidArgumentError naming ``stat_loggers`` otherwise."""
    from sparrow.plugins import import_object

    if isinstance(item, str):
        if item in registry.stat_loggers:
            found = registry.stat_loggers[item]
            item = import_object(found) if isinstance(found, str) else found
        elif ":" in item:
            try:
                item = import_object(item)
            except Exception as exc:  # noqa: BLE001 - any import failure is the argument's fault
                raise InvalidArgumentError(f"stat_loggers: cannot import {item!r}: {exc}", "stat_loggers") from None
        else:
            registered = ", ".join(sorted(registry.stat_loggers)) or "none"
            raise InvalidArgumentError(f"stat_loggers: unknown stat logger {item!r}; registered: {registered} "
                                       "(or give package.module:Class)", "stat_loggers")
    if not callable(item):
        raise InvalidArgumentError(f"stat_loggers: {item!r} is not a stat logger class, factory, registered name or "
                                   "'package.module:Class'", "stat_loggers")
    return item


def resolve_stat_loggers(items: Iterable[Any]) -> list[StatLoggerFactory]:
    """Every entry's factory, looked up before anything is built (a wrong name fails first)."""
    from sparrow.plugins import get_registry

    items = list(items)
    registry = get_registry() if any(isinstance(item, str) for item in items) else None
    return [resolve_stat_logger(item, registry) for item in items]


def build_stat_loggers(factories: Iterable[StatLoggerFactory], config: Any, engine_index: int = 0) -> list[Any]:
    """Call each factory as ``factory(config, engine_index)``; the result needs ``record``."""
    built = []
    for factory in factories:
        made = factory(config, engine_index)
        if not callable(getattr(made, "record", None)):
            raise InvalidArgumentError(f"stat_loggers: {factory!r} made {type(made).__name__}, which has no record() "
                                       "method (subclass sparrow.v1.metrics.loggers.StatLoggerBase)", "stat_loggers")
        built.append(made)
    return built


class StatLoggerManager:
    """Feeds every logger of one frontend: ``record`` per batch, ``maybe_log`` on an interval.
    One thread (the output handler's)."""

    def __init__(self, loggers: list[Any], interval: float, now: float | None = None) -> None:
        self.loggers = list(loggers)
        self.interval = float(interval)
        self.last_log_time = time.monotonic() if now is None else now
        # The scheduler's cumulative counters -> their growth since the snapshot before: one
        # reader for all loggers, so each sees every event once.
        self._deltas = SchedulerStatsDeltas()

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        for stat_logger in list(self.loggers):
            function = getattr(stat_logger, method, None)
            if function is None:
                continue
            try:
                function(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a broken logger must not break the engine
                logger.exception("stat logger %s raised in %s(); it is disabled", type(stat_logger).__name__, method)
                self.loggers.remove(stat_logger)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is None and iteration_stats is None:
            return
        if scheduler_stats is not None:
            scheduler_stats = self._deltas.update(scheduler_stats)
            if iteration_stats is not None:
                iteration_stats.num_preempted_reqs = scheduler_stats.num_preemptions
        self._call("record", scheduler_stats, iteration_stats, engine_idx=0)

    def log_engine_initialized(self) -> None:
        self._call("log_engine_initialized")

    def start(self, now: float | None = None) -> None:
        """Start the current interval at ``now`` (a frontend's first request)."""
        self.last_log_time = time.monotonic() if now is None else now

    def seconds_until_due(self, now: float) -> float:
        return max(0.0, self.last_log_time + self.interval - now)

    def maybe_log(self, now: float | None = None) -> bool:
        """Call every logger's ``log()`` once ``interval`` seconds have passed; True if it did."""
        now = time.monotonic() if now is None else now
        if now - self.last_log_time < self.interval:
            return False
        self.last_log_time = now
        self._call("log")
        return True
