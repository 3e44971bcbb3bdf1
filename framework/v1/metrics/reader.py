"""vLLM's ``vllm.v1.metrics.reader``: what ``LLM.get_metrics()`` returns."""

from sparrow.engine.metrics_reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
