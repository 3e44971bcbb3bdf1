"""vLLM's ``vllm.v1.metrics.stats``: what a stat logger's ``record`` receives."""

from sparrow.engine.iteration_stats import FinishedRequestStats, IterationStats, RequestStateStats
from sparrow.wire import SchedulerStats

__all__ = ["FinishedRequestStats", "IterationStats", "RequestStateStats", "SchedulerStats"]
