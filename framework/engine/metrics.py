"""Prometheus metrics of one AsyncLLM, with vLLM's metric names under the ``sparrow:`` prefix.

Each engine owns a ``CollectorRegistry`` (nothing goes to prometheus_client's global registry),
so two engines in one process, or one per test, never collide. The server's ``/metrics`` renders
``render(engine.metrics)``.

A stat logger (``stat_loggers.StatLoggerBase``) fed by the frontend's ``StatLoggerManager``:
gauges and cache counters from each ``SchedulerStats`` (whose counters arrive as their growth since
the snapshot before, so a snapshot read twice is counted once), token counts and latencies from
each batch's ``IterationStats`` (``iteration_stats``: measured once per batch for every logger, per
engine-core request, so a request with n > 1 counts each of its samples).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE  # noqa: F401 - re-exported
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sparrow.engine.iteration_stats import IterationStats
from sparrow.engine.stat_loggers import StatLoggerBase
from sparrow.wire import SchedulerStats

# vLLM's bucket boundaries, so dashboards built for vLLM read Sparrow's histograms the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Token counts per request: vLLM's 1-2-5 series.
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))


class EngineMetrics(StatLoggerBase):
    """vLLM's ``PrometheusStatLogger`` for one engine; fed by its frontend's output handler."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        names = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        self.num_requests_running = gauge("sparrow:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("sparrow:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("sparrow:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.prefix_cache_queries = counter("sparrow:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("sparrow:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("sparrow:num_preemptions", "Requests preempted (KV cache full).")
        self.prompt_tokens = counter("sparrow:prompt_tokens", "Prompt tokens of requests that started generating "
                                     "(or, on a pooling model, were embedded).")
        self.generation_tokens = counter("sparrow:generation_tokens", "Generated tokens.")
        self.time_to_first_token = histogram(
            "sparrow:time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "sparrow:inter_token_latency_seconds", "Gap between consecutive token outputs of a request.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "sparrow:e2e_request_latency_seconds", "Arrival to finish of a request.", E2E_BUCKETS)
        self.request_prompt_tokens = histogram(
            "sparrow:request_prompt_tokens", "Prompt tokens of finished requests.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "sparrow:request_generation_tokens", "Generated tokens of finished requests.", TOKEN_BUCKETS)
        self._request_success = Counter(
            "sparrow:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry)
        # Speculative decoding (vLLM's spec_decode_* names; all stay 0 with speculation off).
        self.spec_decode_num_drafts = counter("sparrow:spec_decode_num_drafts",
                                              "Verification steps of requests with drafts.")
        self.spec_decode_num_draft_tokens = counter("sparrow:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("sparrow:spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted.")
        self._spec_decode_num_accepted_tokens_per_pos = Counter(
            "sparrow:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position (0 = first).",
            ["model_name", "position"], registry=self.registry)
        self._model_name = model_name

    def log_engine_initialized(self) -> None:
        pass

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self._record_scheduler_stats(scheduler_stats)
        if iteration_stats is None:
            return
        if iteration_stats.num_generation_tokens:
            self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        if iteration_stats.num_prompt_tokens:
            self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        for seconds in iteration_stats.time_to_first_tokens_iter:
            self.time_to_first_token.observe(seconds)
        for seconds in iteration_stats.inter_token_latencies_iter:
            self.inter_token_latency.observe(seconds)
        for finished in iteration_stats.finished_requests:
            self.e2e_request_latency.observe(finished.e2e_latency)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            self._request_success.labels(model_name=self._model_name, finished_reason=finished.finish_reason).inc()

    def _record_scheduler_stats(self, new: SchedulerStats) -> None:
        """One snapshot whose counters are their growth since the snapshot before."""
        self.num_requests_running.set(new.num_running_reqs)
        self.num_requests_waiting.set(new.num_waiting_reqs)
        self.kv_cache_usage.set(new.kv_cache_usage)
        for metric, delta in ((self.prefix_cache_queries, new.prefix_cache_queries),
                              (self.prefix_cache_hits, new.prefix_cache_hits),
                              (self.num_preemptions, new.num_preemptions),
                              (self.spec_decode_num_drafts, new.spec_decode_num_drafts),
                              (self.spec_decode_num_draft_tokens, new.spec_decode_num_draft_tokens),
                              (self.spec_decode_num_accepted_tokens, new.spec_decode_num_accepted_tokens)):
            if delta > 0:
                metric.inc(delta)
        for position, delta in enumerate(new.spec_decode_num_accepted_tokens_per_pos):
            if delta > 0:  # a position's series appears with its first accepted token
                self._spec_decode_num_accepted_tokens_per_pos.labels(
                    model_name=self._model_name, position=str(position)).inc(delta)


def render(metrics: EngineMetrics) -> bytes:
    """The Prometheus text exposition of one engine's registry."""
    return generate_latest(metrics.registry)
