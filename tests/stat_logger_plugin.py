"""A custom stat logger as a user writes one for vLLM (imported by name in tests/test_stat_loggers.py)."""

from __future__ import annotations

from sparrow.hookspecs import hookimpl
from sparrow.v1.metrics.loggers import StatLoggerBase

SPARROW_CONTRACT = ">=1.1,<2"


class RecordingStatLogger(StatLoggerBase):
    """Keeps everything it is handed."""

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        self.config, self.engine_index = vllm_config, engine_index
        self.scheduler_stats: list = []
        self.iterations: list = []
        self.initialized = self.logs = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.scheduler_stats.append(scheduler_stats)
        if iteration_stats is not None:
            self.iterations.append(iteration_stats)

    def log_engine_initialized(self) -> None:
        self.initialized += 1

    def log(self) -> None:
        self.logs += 1

    def total(self, field: str) -> int:
        return sum(getattr(iteration, field) for iteration in self.iterations)

    def finished(self) -> list:
        return [done for iteration in self.iterations for done in iteration.finished_requests]


@hookimpl
def sparrow_register_stat_loggers(register) -> None:
    register("recording", RecordingStatLogger)
