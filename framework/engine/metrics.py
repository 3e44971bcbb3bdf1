"""Prometheus metrics of one AsyncLLM, with vLLM's metric names under the ``sparrow:`` prefix.

Each engine owns a ``CollectorRegistry`` (nothing goes to prometheus_client's global registry),
so two engines in one process, or one per test, never collide. The server's ``/metrics`` renders
``render(engine.metrics)``.

Gauges and cache counters come from the ``SchedulerStats`` every engine-core step carries (its
counters are cumulative: each Prometheus counter grows by the difference from the last snapshot
seen, so a snapshot read twice, by a step and by ``get_scheduler_stats``, is counted once; see
``stats_deltas``). Token counts and latencies are measured in the frontend from the engine-core
outputs as they arrive, per engine-core request (a request with n > 1 counts each of its
samples), in ``time.monotonic()`` seconds, the clock ``arrival_time`` is stamped with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE  # noqa: F401 - re-exported
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sparrow.engine.stats_deltas import SchedulerStatsDeltas
from sparrow.wire import EngineCoreOutput, SchedulerStats

# vLLM's bucket boundaries, so dashboards built for vLLM read Sparrow's histograms the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class _RequestTimes:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None


class EngineMetrics:
    """Records one engine's stats; called by AsyncLLM's output handler (one asyncio task)."""

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
        self.prompt_tokens = counter("sparrow:prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("sparrow:generation_tokens", "Generated tokens.")
        self.time_to_first_token = histogram(
            "sparrow:time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "sparrow:inter_token_latency_seconds", "Gap between consecutive token outputs of a request.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "sparrow:e2e_request_latency_seconds", "Arrival to finish of a request.", E2E_BUCKETS)
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
        # engine-core request id -> its timestamps while unfinished
        self._requests: dict[str, _RequestTimes] = {}
        # The scheduler's cumulative counters -> their growth since the last stats recorded.
        self._deltas = SchedulerStatsDeltas()

    # -- per request ------------------------------------------------------------------------
    def request_added(self, engine_request_id: str, arrival_time: float) -> None:
        self._requests[engine_request_id] = _RequestTimes(arrival_time=arrival_time or time.monotonic())

    def record_outputs(self, outputs: list[EngineCoreOutput], num_prompt_tokens: dict[str, int],
                       now: float | None = None) -> None:
        """One batch of engine-core outputs. ``num_prompt_tokens``: engine id -> prompt length,
        counted once, with the request's first token."""
        now = time.monotonic() if now is None else now
        for output in outputs:
            times = self._requests.get(output.request_id)
            if times is None or not output.new_token_ids:
                continue
            self.generation_tokens.inc(len(output.new_token_ids))
            if times.first_token_time is None:
                times.first_token_time = now
                self.time_to_first_token.observe(now - times.arrival_time)
                self.prompt_tokens.inc(num_prompt_tokens.get(output.request_id, 0))
            else:
                self.inter_token_latency.observe(now - (times.last_token_time or now))
            times.last_token_time = now

    def request_finished(self, engine_request_id: str, finish_reason: str, now: float | None = None) -> None:
        """Called once per engine-core request: finished in the core, stopped by a stop string,
        aborted, or rejected."""
        times = self._requests.pop(engine_request_id, None)
        if times is None:
            return
        now = time.monotonic() if now is None else now
        self.e2e_request_latency.observe(now - times.arrival_time)
        self._request_success.labels(model_name=self._model_name, finished_reason=finish_reason).inc()

    # -- per step ---------------------------------------------------------------------------
    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """One snapshot. Its counters are cumulative, so the Prometheus counters grow by what is
        new since the last snapshot recorded; an older snapshot arriving late adds nothing."""
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        new = self._deltas.update(stats)
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
