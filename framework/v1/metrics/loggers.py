"""vLLM's ``vllm.v1.metrics.loggers``: the stat logger interface and the built-in loggers."""

from sparrow.engine.metrics import EngineMetrics as PrometheusStatLogger
from sparrow.engine.stat_loggers import StatLoggerBase, StatLoggerFactory, StatLoggerManager
from sparrow.engine.stats_log import LoggingStatLogger

__all__ = ["LoggingStatLogger", "PrometheusStatLogger", "StatLoggerBase", "StatLoggerFactory", "StatLoggerManager"]
