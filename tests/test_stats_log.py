"""vLLM's periodic stats log line ("Engine 000: Avg prompt throughput: ... tokens/s, ..."):
the LoggingStatLogger on a fake clock, then AsyncLLM, LLM and ``sparrow serve`` for real, each with it
on and off (``disable_log_stats`` / ``log_stats_interval``).

No timing is asserted: waits are generous "does not hang" bounds, and the numbers checked are
those of the fake clock.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import pytest

from sparrow import LLM, AsyncLLM, SamplingParams
from sparrow.engine.iteration_stats import IterationStats, RequestStatsTracker
from sparrow.engine.metrics import EngineMetrics
from sparrow.engine.stat_loggers import StatLoggerManager
from sparrow.engine.stats_deltas import SchedulerStatsDeltas
from sparrow.engine.stats_log import LoggingStatLogger
from sparrow.wire import SCHEDULER_STATS_COUNTERS, EngineCoreOutput, FinishReason, SchedulerStats

LOGGER = "sparrow.engine.stats_log"
LINE = re.compile(
    r"Engine 000: Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, "
    r"Avg generation throughput: (?P<gen>[\d.]+) tokens/s, Running: (?P<running>\d+) reqs, "
    r"Waiting: (?P<waiting>\d+) reqs, KV cache usage: (?P<kv>[\d.]+)%, Prefix cache hit rate: (?P<hit>[\d.]+)%")
WAIT_S = 60  # "does not hang"


def out(request_id: str, num_tokens: int, finished: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, list(range(num_tokens)),
                            finish_reason=FinishReason.LENGTH if finished else None)


def lines(records) -> list[re.Match]:
    return [m for r in records if r.name == LOGGER and (m := LINE.search(r.getMessage()))]


class Feed:
    """The frontend's path on a fake clock: a tracker measures each batch once, the manager turns
    snapshots into growths and hands both to the line logger."""

    def __init__(self, interval: float, now: float, prompt_lens: dict[str, int] | None = None) -> None:
        self.line = LoggingStatLogger(interval=interval, now=now)
        self.manager = StatLoggerManager([self.line], interval, now=now)
        self.tracker = RequestStatsTracker()
        for request_id, prompt_len in (prompt_lens or {}).items():
            self.tracker.add_request(request_id, now, prompt_len, None)

    def batch(self, outputs: list[EngineCoreOutput], stats: SchedulerStats | None = None) -> IterationStats:
        iteration = IterationStats()
        self.tracker.update_from_outputs(iteration, outputs, now=0.0)
        self.manager.record(stats, iteration)
        return iteration


# -- the stats line, on a fake clock --------------------------------------------------------------
def test_the_line_carries_the_deltas_fed_since_the_last_one(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    feed = Feed(2.0, 100.0, {"a": 100, "b": 200, "c": 50})
    feed.batch([out("a", 1), out("b", 1)])  # first tokens: 300 prompt tokens
    feed.batch([out("a", 3), out("b", 4, finished=True), out("gone", 9)],  # "gone": not tracked
               SchedulerStats(num_running_reqs=4, num_waiting_reqs=2, kv_cache_usage=0.125,
                              prefix_cache_queries=400, prefix_cache_hits=172))
    feed.line.log(102.0)
    (line,) = lines(caplog.records)
    assert caplog.records[0].levelno == logging.INFO
    assert line.group(0) == ("Engine 000: Avg prompt throughput: 150.0 tokens/s, Avg generation throughput: "
                             "4.5 tokens/s, Running: 4 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, "
                             "Prefix cache hit rate: 43.0%")

    # Next interval: counters are cumulative in the snapshots, so only the growth counts, and a
    # snapshot seen twice (an output and get_scheduler_stats) or late counts nothing more.
    caplog.clear()
    snapshot = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5, prefix_cache_queries=500,
                              prefix_cache_hits=222)
    feed.batch([out("a", 2), out("c", 2)], snapshot)  # "a" started already; "c" first: 50
    feed.manager.record(snapshot, None)
    feed.manager.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5, prefix_cache_queries=450,
                                       prefix_cache_hits=200), None)
    feed.line.log(106.0)  # 4 s after the last line
    (line,) = lines(caplog.records)
    assert (line["prompt"], line["gen"], line["running"], line["waiting"], line["kv"], line["hit"]) == \
        ("12.5", "1.0", "1", "0", "50.0", "50.0")


def test_an_idle_engine_logs_at_debug_once_its_previous_line_was_idle_too(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    feed = Feed(1.0, 0.0, {"a": 10})
    feed.line.log(1.0)  # idle from the start: DEBUG, as vLLM
    feed.batch([out("a", 5)], SchedulerStats(num_running_reqs=1))
    feed.line.log(2.0)  # busy: INFO
    feed.batch([out("a", 5, finished=True)], SchedulerStats())
    feed.line.log(3.0)  # busy part of the interval: INFO
    feed.line.log(4.0)  # idle, but the previous line was not: INFO (the engine went idle)
    feed.line.log(5.0)  # idle after idle: DEBUG
    feed.manager.record(SchedulerStats(num_waiting_reqs=1), None)
    feed.line.log(6.0)  # a request waits: INFO
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.DEBUG, logging.INFO, logging.INFO, logging.INFO, logging.DEBUG, logging.INFO]
    gens = [m["gen"] for m in lines(caplog.records)]
    assert gens == ["0.0", "5.0", "5.0", "0.0", "0.0", "0.0"]


def test_speculative_decoding_acceptance_is_logged_when_the_stats_carry_it(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    feed = Feed(1.0, 0.0)
    feed.manager.record(SchedulerStats(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
                                       spec_decode_num_accepted_tokens=15,
                                       spec_decode_num_accepted_tokens_per_pos=[8, 5, 2]), None)
    feed.line.log(2.0)
    spec = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert spec == ["Engine 000: SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: "
                    "7.50 tokens/s, Drafted throughput: 15.00 tokens/s, Accepted: 15 tokens, Drafted: 30 tokens, "
                    "Per-position acceptance rate: 0.800, 0.500, 0.200, Avg Draft acceptance rate: 50.0%"]
    caplog.clear()
    feed.line.log(3.0)  # nothing new: no speculative line
    assert not any("SpecDecoding" in r.getMessage() for r in caplog.records)


def test_the_manager_logs_when_the_interval_is_due_and_drops_a_logger_that_raises(caplog):
    class Counting:
        def __init__(self) -> None:
            self.logs = self.records = 0

        def record(self, scheduler_stats, iteration_stats, engine_idx=0) -> None:
            self.records += 1

        def log(self) -> None:
            self.logs += 1

    class Broken(Counting):
        def record(self, scheduler_stats, iteration_stats, engine_idx=0) -> None:
            raise RuntimeError("a bug in the logger")

    counting, broken = Counting(), Broken()
    manager = StatLoggerManager([broken, counting], interval=2.0, now=10.0)
    assert manager.seconds_until_due(11.0) == 1.0
    assert not manager.maybe_log(11.5)
    assert manager.maybe_log(12.0) and (counting.logs, broken.logs) == (1, 1)
    caplog.set_level(logging.ERROR, logger="sparrow.engine.stat_loggers")
    manager.record(SchedulerStats(), None)
    manager.record(SchedulerStats(), IterationStats())
    assert counting.records == 2 and manager.loggers == [counting]
    assert [r.getMessage() for r in caplog.records] == ["stat logger Broken raised in record(); it is disabled"]
    with pytest.raises(ValueError):
        LoggingStatLogger(interval=0)


def test_the_tracker_measures_each_request_once_and_forgets_it_when_it_ends():
    tracker = RequestStatsTracker()
    tracker.add_request("a", 10.0, 7, 5)
    tracker.add_request("b", 10.0, 3, None)
    first = IterationStats()
    tracker.update_from_outputs(first, [out("a", 2), out("b", 0), out("gone", 4)], now=11.0)
    assert (first.num_prompt_tokens, first.num_generation_tokens, first.time_to_first_tokens_iter) == (7, 2, [1.0])
    second = IterationStats()
    tracker.update_from_outputs(second, [out("a", 3, finished=True), out("b", 1)], now=11.5)
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (3, 4)
    assert (second.time_to_first_tokens_iter, second.inter_token_latencies_iter) == ([1.5], [0.5])
    (done,) = second.finished_requests
    assert (done.finish_reason, done.e2e_latency, done.num_prompt_tokens, done.num_generation_tokens,
            done.max_tokens_param, done.time_to_first_token) == ("length", 1.5, 7, 5, 5, 1.0)
    aborted = IterationStats()
    tracker.finish(aborted, "b", "abort", now=12.0)
    tracker.finish(aborted, "b", "abort", now=13.0)  # once only
    assert [(f.finish_reason, f.e2e_latency, f.num_generation_tokens) for f in aborted.finished_requests] == \
        [("abort", 2.0, 1)]
    assert len(tracker) == 0


# -- the growth of the cumulative counters, shared with the Prometheus metrics --------------------
def test_scheduler_stats_deltas_count_each_event_once():
    deltas = SchedulerStatsDeltas()
    first = deltas.update(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.25, num_total_blocks=8,
                                         prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1,
                                         spec_decode_num_accepted_tokens_per_pos=[2]))
    assert (first.num_running_reqs, first.kv_cache_usage, first.num_total_blocks) == (3, 0.25, 8)  # gauges kept
    assert (first.prefix_cache_queries, first.prefix_cache_hits, first.num_preemptions) == (10, 4, 1)
    assert first.spec_decode_num_accepted_tokens_per_pos == [2]

    snapshot = SchedulerStats(num_waiting_reqs=1, prefix_cache_queries=30, prefix_cache_hits=12, num_preemptions=1,
                              kv_connector_loaded_tokens=16, spec_decode_num_drafts=5,
                              spec_decode_num_accepted_tokens_per_pos=[3, 4, 1])
    grown = deltas.update(snapshot)
    assert (grown.num_running_reqs, grown.num_waiting_reqs) == (0, 1)
    assert (grown.prefix_cache_queries, grown.prefix_cache_hits, grown.num_preemptions) == (20, 8, 0)
    assert (grown.kv_connector_loaded_tokens, grown.spec_decode_num_drafts) == (16, 5)
    assert grown.spec_decode_num_accepted_tokens_per_pos == [1, 4, 1]
    assert snapshot.prefix_cache_queries == 30  # the snapshot itself is left as it was

    again = deltas.update(snapshot)  # the same snapshot read twice (a step, then get_scheduler_stats)
    late = deltas.update(SchedulerStats(prefix_cache_queries=20, prefix_cache_hits=8,
                                        spec_decode_num_accepted_tokens_per_pos=[1]))  # older, arriving late
    for nothing_new in (again, late):
        assert all(getattr(nothing_new, name) == 0 for name in SCHEDULER_STATS_COUNTERS)
        assert nothing_new.spec_decode_num_accepted_tokens_per_pos == [0, 0, 0]  # as long as the longest seen
    assert deltas.update(SchedulerStats(prefix_cache_queries=31, prefix_cache_hits=13)).prefix_cache_hits == 1


def test_the_metrics_and_the_stats_line_count_the_same_growth():
    snapshots = [SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=4, spec_decode_num_drafts=2,
                                spec_decode_num_draft_tokens=6, spec_decode_num_accepted_tokens=3,
                                spec_decode_num_accepted_tokens_per_pos=[2, 1, 0]),
                 SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=4),  # counters of an older step
                 SchedulerStats(prefix_cache_queries=50, prefix_cache_hits=24, spec_decode_num_drafts=4,
                                spec_decode_num_draft_tokens=12, spec_decode_num_accepted_tokens=7,
                                spec_decode_num_accepted_tokens_per_pos=[4, 2, 1])]
    metrics, line = EngineMetrics("m"), LoggingStatLogger(interval=1.0, now=0.0)
    manager = StatLoggerManager([metrics, line], interval=1.0, now=0.0)
    for stats in snapshots:
        manager.record(stats, None)
    names = ("prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens")
    prometheus = [metrics.registry.get_sample_value(f"sparrow:{name}_total", {"model_name": "m"}) for name in names]
    assert prometheus == [getattr(line, name) for name in names] == [50, 24, 4, 12, 7]
    per_pos = [metrics.registry.get_sample_value("sparrow:spec_decode_num_accepted_tokens_per_pos_total",
                                                 {"model_name": "m", "position": str(p)}) for p in range(3)]
    assert per_pos == line.spec_decode_num_accepted_tokens_per_pos == [4, 2, 1]


def test_the_stats_line_counts_a_real_engines_prefix_cache_lookups_once(qwen3_dir):
    # The same long prompt twice: the second finds its full blocks in the prefix cache. Every step
    # brings a cumulative snapshot; the line sums their growth (no line is due in the hour).
    prompt = {"prompt_token_ids": [(7 * i) % 97 + 3 for i in range(80)]}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(qwen3_dir, disable_log_stats=False, log_stats_interval=3600, max_model_len=256) as llm:
        llm.generate([prompt], params, use_tqdm=False)
        llm.generate([prompt], params, use_tqdm=False)
        engine = llm.llm_engine
        latest = engine.last_stats
        assert latest is not None and engine.stat_logger is not None
        assert latest.prefix_cache_hits > 0
        assert (engine.stat_logger.prefix_cache_queries, engine.stat_logger.prefix_cache_hits) == \
            (latest.prefix_cache_queries, latest.prefix_cache_hits)
        # vLLM's LLM.get_metrics(): the same counts, as the objects vLLM's reader returns.
        from sparrow.engine.metrics_reader import Counter, Gauge, Histogram

        metrics = {metric.name: metric for metric in llm.get_metrics()}
        assert isinstance(metrics["sparrow:prefix_cache_hits"], Counter)
        assert metrics["sparrow:prefix_cache_hits"].value == latest.prefix_cache_hits
        assert metrics["sparrow:prompt_tokens"].value == 2 * 80
        assert metrics["sparrow:generation_tokens"].value == 2 * 4
        assert isinstance(metrics["sparrow:num_requests_running"], Gauge)
        assert metrics["sparrow:num_requests_running"].value == 0
        ttft = metrics["sparrow:time_to_first_token_seconds"]
        assert isinstance(ttft, Histogram) and ttft.count == 2 and ttft.buckets["+Inf"] == 2
        assert ttft.labels == {"model_name": qwen3_dir}
    with LLM(qwen3_dir, max_model_len=256) as quiet, pytest.raises(ValueError, match="disable_log_stats=False"):
        quiet.get_metrics()


# -- AsyncLLM -----------------------------------------------------------------------------------
def run_async(engine_args: dict, wait_for_line: bool) -> tuple[list, list]:
    """Run a few requests on a real AsyncLLM (built-in model); then wait for a stats line (or
    two intervals). Returns the stats log records before and after shutdown."""
    handler = _Collect()
    logging.getLogger(LOGGER).addHandler(handler)
    logging.getLogger(LOGGER).setLevel(logging.DEBUG)

    async def main():
        engine = AsyncLLM.from_engine_args(model=None, **engine_args)
        try:
            params = SamplingParams(max_tokens=40, ignore_eos=True)

            async def one(i):
                return [o async for o in engine.generate(f"prompt number {i}", params, f"req-{i}")]

            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), WAIT_S)
            deadline = time.monotonic() + (WAIT_S if wait_for_line else 1.2)
            while time.monotonic() < deadline and not (wait_for_line and any(
                    float(m["gen"]) > 0 for m in lines(handler.records))):
                await asyncio.sleep(0.05)
        finally:
            engine.shutdown()
        before = list(handler.records)
        for _ in range(20):  # the handler's cancellation, then the stats task's
            await asyncio.sleep(0)
        assert not [task for task in asyncio.all_tasks() if task.get_name() == "AsyncLLM.stats_logger"]
        await asyncio.sleep(1.2)  # two intervals: nothing more is logged after shutdown
        return before, list(handler.records)

    try:
        return asyncio.run(main())
    finally:
        logging.getLogger(LOGGER).removeHandler(handler)
        logging.getLogger(LOGGER).setLevel(logging.NOTSET)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_async_llm_logs_the_line_every_interval_and_stops_at_shutdown():
    before, after = run_async({"log_stats_interval": 0.5}, wait_for_line=True)
    found = lines(before)
    assert any(float(m["gen"]) > 0 and float(m["prompt"]) > 0 for m in found), [r.getMessage() for r in before]
    assert any(r.levelno == logging.INFO for r in before)
    assert len(after) == len(before)


def test_async_llm_with_disable_log_stats_logs_nothing():
    before, after = run_async({"log_stats_interval": 0.5, "disable_log_stats": True}, wait_for_line=False)
    assert before == [] and after == []


# -- LLM ----------------------------------------------------------------------------------------
def test_llm_logs_the_line_only_when_asked_to(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [f"prompt number {i}" for i in range(3)]
    # 40 engine steps (each a model forward and a round trip to the engine core process) take far
    # longer than 0.01 s, and every step brings tokens.
    llm = LLM(disable_log_stats=False, log_stats_interval=0.01)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    found = lines(caplog.records)
    assert found and any(float(m["gen"]) > 0 for m in found)
    caplog.clear()
    llm = LLM(log_stats_interval=0.01)  # disable_log_stats None: no line, as vLLM's LLM
    try:
        assert llm.llm_engine.stat_logger is None
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert lines(caplog.records) == []


# -- sparrow serve --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from sparrow.tiny.model import build_model_dir

    return str(build_model_dir(tmp_path_factory.mktemp("stats-model"), "qwen3", "test", seed=5))


@pytest.mark.parametrize("disabled", [False, True], ids=["logged", "disabled"])
def test_sparrow_serve_logs_the_line_unless_disabled(model_dir, tmp_path, disabled):
    from tests.test_server_lifecycle import MODEL_NAME, ServerProcess

    # --log-level: the line is INFO, whatever SPARROW_LOGGING_LEVEL the environment holds.
    # --log-level: the line is INFO, whatever SPARROW_LOGGING_LEVEL the environment holds.
    flags = ["--log-level", "INFO", "--log-stats-interval", "0.5"] + (["--disable-log-stats"] if disabled else [])
    server = ServerProcess(model_dir, tmp_path / "server.log", *flags)
    try:
        response = httpx.post(server.url + "/v1/completions", timeout=WAIT_S, json={
            "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True})
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + (1.5 if disabled else WAIT_S)
        found: list[re.Match] = []
        while time.monotonic() < deadline and not found:
            found = [m for m in LINE.finditer(server.log()) if float(m["gen"]) > 0]
            time.sleep(0.1)
        if disabled:
            assert "Avg generation throughput" not in server.log()
        else:
            assert found, server.log()
            assert f"INFO {LOGGER}: Engine 000: Avg prompt throughput" in server.log()
    finally:
        server.stop()


def test_the_line_of_data_parallel_engines_says_it_is_their_sum():
    one, two = LoggingStatLogger(interval=1.0, now=0.0), LoggingStatLogger(interval=1.0, now=0.0, num_engines=2)
    assert one.format_lines(1.0)[0].startswith("Engine 000: Avg prompt throughput: ")
    assert two.format_lines(1.0)[0].startswith("2 Engines Aggregated: Avg prompt throughput: ")
