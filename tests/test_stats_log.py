"""vLLM's periodic stats log line ("Engine 000: Avg prompt throughput: ... tokens/s, ..."):
the StatsLogger on a fake clock, then AsyncLLM, LLM and ``sparrow serve`` for real, each with it
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
from sparrow.engine.stats_log import StatsLogger
from sparrow.wire import EngineCoreOutput, FinishReason, SchedulerStats

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


# -- the StatsLogger, on a fake clock ------------------------------------------------------------
def test_the_line_carries_the_deltas_fed_since_the_last_one(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    stats = StatsLogger(interval=2.0, now=100.0)
    prompt_lens = {"a": 100, "b": 200, "c": 50}
    stats.record_outputs([out("a", 1), out("b", 1)], prompt_lens)  # first tokens: 300 prompt tokens
    stats.record_outputs([out("a", 3), out("b", 4, finished=True), out("gone", 9)], prompt_lens)
    stats.record_scheduler_stats(SchedulerStats(num_running_reqs=4, num_waiting_reqs=2, kv_cache_usage=0.125,
                                                prefix_cache_queries=400, prefix_cache_hits=172))
    assert not stats.maybe_log(101.5)  # not yet due
    assert caplog.records == []
    assert stats.maybe_log(102.0)
    (line,) = lines(caplog.records)
    assert caplog.records[0].levelno == logging.INFO
    assert line.group(0) == ("Engine 000: Avg prompt throughput: 150.0 tokens/s, Avg generation throughput: "
                             "4.5 tokens/s, Running: 4 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, "
                             "Prefix cache hit rate: 43.0%")

    # Next interval: counters are cumulative in the snapshots, so only the growth counts, and a
    # snapshot seen twice (an output and get_scheduler_stats) or late counts nothing more.
    caplog.clear()
    stats.record_outputs([out("a", 2), out("c", 2)], prompt_lens)  # "a" started already; "c" first: 50
    snapshot = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5, prefix_cache_queries=500,
                              prefix_cache_hits=222)
    stats.record_scheduler_stats(snapshot)
    stats.record_scheduler_stats(snapshot)
    stats.record_scheduler_stats(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5, prefix_cache_queries=450,
                                                prefix_cache_hits=200))
    stats.log(106.0)  # forced, 4 s after the last line
    (line,) = lines(caplog.records)
    assert (line["prompt"], line["gen"], line["running"], line["waiting"], line["kv"], line["hit"]) == \
        ("12.5", "1.0", "1", "0", "50.0", "50.0")


def test_an_idle_engine_logs_at_debug_once_its_previous_line_was_idle_too(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    stats = StatsLogger(interval=1.0, now=0.0)
    stats.maybe_log(1.0)  # idle from the start: DEBUG, as vLLM
    stats.record_outputs([out("a", 5)], {"a": 10})
    stats.record_scheduler_stats(SchedulerStats(num_running_reqs=1))
    stats.maybe_log(2.0)  # busy: INFO
    stats.record_outputs([out("a", 5, finished=True)], {"a": 10})
    stats.record_scheduler_stats(SchedulerStats())
    stats.maybe_log(3.0)  # busy part of the interval: INFO
    stats.maybe_log(4.0)  # idle, but the previous line was not: INFO (the engine went idle)
    stats.maybe_log(5.0)  # idle after idle: DEBUG
    stats.record_scheduler_stats(SchedulerStats(num_waiting_reqs=1))
    stats.maybe_log(6.0)  # a request waits: INFO
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.DEBUG, logging.INFO, logging.INFO, logging.INFO, logging.DEBUG, logging.INFO]
    gens = [m["gen"] for m in lines(caplog.records)]
    assert gens == ["0.0", "5.0", "5.0", "0.0", "0.0", "0.0"]


def test_speculative_decoding_acceptance_is_logged_when_the_stats_carry_it(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    stats = StatsLogger(interval=1.0, now=0.0)
    stats.record_scheduler_stats(SchedulerStats(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
                                                spec_decode_num_accepted_tokens=15,
                                                spec_decode_num_accepted_tokens_per_pos=[8, 5, 2]))
    stats.log(2.0)
    spec = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert spec == ["Engine 000: SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: "
                    "7.50 tokens/s, Drafted throughput: 15.00 tokens/s, Accepted: 15 tokens, Drafted: 30 tokens, "
                    "Per-position acceptance rate: 0.800, 0.500, 0.200, Avg Draft acceptance rate: 50.0%"]
    caplog.clear()
    stats.log(3.0)  # nothing new: no speculative line
    assert not any("SpecDecoding" in r.getMessage() for r in caplog.records)


def test_requests_forgotten_by_the_frontend_are_not_kept():
    stats = StatsLogger(interval=1.0, now=0.0)
    prompt_lens = {f"r{i}": 4 for i in range(200)}
    stats.record_outputs([out(rid, 1) for rid in prompt_lens], prompt_lens)
    prompt_lens.clear()  # all aborted after their first token
    stats.record_outputs([], prompt_lens)
    assert stats._started == set()
    with pytest.raises(ValueError):
        StatsLogger(interval=0)


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
