"""Scheduler and engine-core behaviour against a fake executor (the far side of the unit)."""

from __future__ import annotations

import pytest

from sparrow.config import ConfigError, EngineConfig
from sparrow.engine.core import EngineCore
from sparrow.engine.messages import EngineCoreRequest
from sparrow.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor, next_token


def make_engine(num_blocks=64, block_size=16, **kwargs) -> tuple[EngineCore, FakeExecutor]:
    kwargs.setdefault("max_model_len", 4096)
    executor = FakeExecutor(num_blocks=num_blocks, block_size=block_size)
    config = EngineConfig.from_kwargs(**kwargs)
    return EngineCore(config, executor=executor), executor


def make_request(req_id: str, prompt_len: int, max_tokens: int = 4, start: int = 1, **kwargs) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    prompt = [(start + i) % 1000 for i in range(prompt_len)]
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
                             max_tokens=max_tokens, **kwargs)


def expected_output(request: EngineCoreRequest, vocab_size: int = 1000) -> list[int]:
    tokens = list(request.prompt_token_ids)
    for _ in range(request.max_tokens):
        tokens.append(next_token(tokens, vocab_size))
    return tokens[len(request.prompt_token_ids):]


def run_to_completion(engine: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return outputs


def test_long_prompt_is_chunked_under_budget():
    engine, executor = make_engine(num_blocks=128, max_num_batched_tokens=256)
    request = make_request("long", 1000, max_tokens=3)
    engine.add_request(request)
    outputs = run_to_completion(engine)
    per_step = [so.num_scheduled_tokens["long"] for so in executor.history]
    assert per_step == [256, 256, 256, 232, 1, 1]
    assert outputs["long"] == expected_output(request)
    assert engine.kv_cache_manager.num_free_blocks == 128


def test_running_requests_are_served_before_new_prefills():
    engine, executor = make_engine(max_num_batched_tokens=64)
    engine.add_request(make_request("a", 10, max_tokens=8))
    engine.step()  # a: prefill
    engine.add_request(make_request("b", 200, max_tokens=2))
    engine.step()
    step = executor.history[-1]
    assert list(step.num_scheduled_tokens) == ["a", "b"]
    assert step.num_scheduled_tokens == {"a": 1, "b": 63}
    assert step.scheduled_cached_reqs.req_ids == ["a"]
    assert [r.req_id for r in step.scheduled_new_reqs] == ["b"]


def test_preemption_frees_blocks_and_the_request_resumes_and_finishes():
    # 8 blocks of 4 tokens = 32 slots; two requests that each grow to 20 tokens cannot both fit.
    engine, executor = make_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    first, second = make_request("first", 8, max_tokens=12), make_request("second", 8, max_tokens=12, start=50)
    engine.add_request(first)
    engine.add_request(second)
    outputs = run_to_completion(engine)
    resumed = {new.req_id for so in executor.history for new in so.scheduled_new_reqs if new.output_token_ids}
    assert resumed == {"second"}, "the latest arrival is preempted under FCFS and resumes with its output"
    assert outputs["first"] == expected_output(first)
    assert outputs["second"] == expected_output(second)
    assert engine.kv_cache_manager.num_free_blocks == 8


def test_priority_policy_preempts_the_lowest_priority():
    engine, executor = make_engine(num_blocks=8, block_size=4, scheduler="priority", max_num_batched_tokens=64)
    # Lower value = more important (vLLM's convention). "low" arrives first but is less important.
    engine.add_request(make_request("low", 8, max_tokens=12, priority=5))
    engine.add_request(make_request("high", 8, max_tokens=12, priority=0, start=50))
    outputs = run_to_completion(engine)
    resumed = {new.req_id for so in executor.history for new in so.scheduled_new_reqs if new.output_token_ids}
    assert resumed == {"low"}
    assert len(outputs["low"]) == 12 and len(outputs["high"]) == 12


def test_priority_policy_admits_by_priority():
    engine, executor = make_engine(scheduler="priority", max_num_seqs=1)
    engine.add_request(make_request("later", 4, max_tokens=1, priority=3))
    engine.add_request(make_request("urgent", 4, max_tokens=1, priority=1))
    run_to_completion(engine)
    assert [r.req_id for so in executor.history for r in so.scheduled_new_reqs] == ["urgent", "later"]


def test_vllms_scheduling_policy_picks_the_scheduler(qwen3_dir):
    """scheduling_policy="priority" (vLLM's argument) runs the priority scheduler: the same
    admission order as scheduler="priority"; with a disagreeing scheduler it is refused by name."""
    engine, executor = make_engine(scheduling_policy="priority", max_num_seqs=1)
    engine.add_request(make_request("later", 4, max_tokens=1, priority=3))
    engine.add_request(make_request("urgent", 4, max_tokens=1, priority=1))
    run_to_completion(engine)
    assert [r.req_id for so in executor.history for r in so.scheduled_new_reqs] == ["urgent", "later"]
    assert EngineConfig.from_kwargs(scheduling_policy="fcfs").scheduler.scheduler == "fcfs"
    with pytest.raises(ConfigError, match="scheduling_policy='priority' and scheduler='sjf' disagree"):
        EngineConfig.from_kwargs(scheduling_policy="priority", scheduler="sjf")
    with pytest.raises(ConfigError, match="'scheduling_policy'"):
        EngineConfig.from_kwargs(scheduling_policy="sjf")  # vLLM has only fcfs and priority
    # Offline, as a vLLM user writes it: priorities are honoured instead of refused.
    from sparrow import LLM, SamplingParams

    llm = LLM(qwen3_dir, scheduling_policy="priority", multiprocess=False, max_model_len=128)
    try:
        outputs = llm.generate(["a b c", "d e f"], SamplingParams(max_tokens=2, temperature=0), priority=[1, 0],
                               use_tqdm=False)
        assert [len(output.outputs[0].token_ids) for output in outputs] == [2, 2]
    finally:
        llm.shutdown()


def test_abort_waiting_running_and_preempted_frees_everything():
    engine, executor = make_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64, max_num_seqs=2)
    engine.add_request(make_request("run", 8, max_tokens=20))
    engine.add_request(make_request("victim", 8, max_tokens=20, start=50))
    engine.add_request(make_request("wait", 8, max_tokens=20, start=90))
    states = set()
    for _ in range(30):
        engine.step()
        sched = engine.scheduler
        states = {r.request_id: r.status.name for r in list(sched.waiting) + sched.running}
        if states.get("victim") == "PREEMPTED":
            break
    assert states == {"run": "RUNNING", "victim": "PREEMPTED", "wait": "WAITING"}
    engine.abort_requests(["run", "victim", "wait"])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == 8
    # The workers hear about every aborted request on the next step.
    engine.add_request(make_request("next", 4, max_tokens=1))
    engine.step()
    assert {"run", "victim"} <= set(executor.history[-1].finished_req_ids)


def test_max_num_seqs_holds():
    engine, executor = make_engine(max_num_seqs=3)
    for i in range(8):
        engine.add_request(make_request(f"r{i}", 5, max_tokens=6, start=i * 10))
    run_to_completion(engine)
    assert max(len(so.num_scheduled_tokens) for so in executor.history) == 3


def test_request_that_can_never_fit_is_rejected_at_add_time():
    engine, _ = make_engine(num_blocks=4, block_size=4)  # 16 tokens in all
    with pytest.raises(ValueError, match="needs KV cache for 30 tokens.*holds 16 tokens"):
        engine.add_request(make_request("huge", 20, max_tokens=10))
    assert not engine.has_unfinished_requests()


def test_prefix_cache_hit_starts_computed_tokens_higher():
    engine, executor = make_engine(block_size=4)
    engine.add_request(make_request("a", 17, max_tokens=1))
    run_to_completion(engine)
    engine.add_request(make_request("b", 17, max_tokens=1))
    run_to_completion(engine)
    new_b = [n for so in executor.history for n in so.scheduled_new_reqs if n.req_id == "b"][0]
    assert new_b.num_computed_tokens == 16  # four full blocks hit; the last token is recomputed


def test_chunked_prefill_off_waits_for_a_whole_prompt():
    engine, executor = make_engine(max_num_batched_tokens=64, enable_chunked_prefill=False)
    engine.add_request(make_request("a", 40, max_tokens=2))
    engine.add_request(make_request("b", 40, max_tokens=2, start=100))
    engine.step()
    assert executor.history[-1].num_scheduled_tokens == {"a": 40}
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request(make_request("c", 100, max_tokens=2))


def test_long_prefill_token_threshold_caps_a_prompt_per_step():
    engine, executor = make_engine(max_num_batched_tokens=256, long_prefill_token_threshold=50)
    engine.add_request(make_request("a", 120, max_tokens=1))
    run_to_completion(engine)
    assert [so.num_scheduled_tokens["a"] for so in executor.history] == [50, 50, 20]


def test_unknown_scheduler_lists_registered_ones():
    with pytest.raises(ValueError, match="unknown scheduler 'nope'.*fcfs.*priority"):
        make_engine(scheduler="nope")


def test_stats_are_snapshots_with_cumulative_counters():
    # The preemption scenario above, plus a prefix hit: counters add up over the steps, and
    # reading them (from a step's output or directly) never resets them.
    engine, executor = make_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    engine.add_request(make_request("first", 8, max_tokens=12))
    engine.add_request(make_request("second", 8, max_tokens=12, start=50))
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append(engine.step().scheduler_stats)
    resumes = sum(1 for so in executor.history for new in so.scheduled_new_reqs if new.output_token_ids)
    assert resumes > 0
    preemptions = [stats.num_preemptions for stats in per_step]
    assert preemptions == sorted(preemptions) and preemptions[-1] == resumes
    first = engine.scheduler.make_stats()
    assert first == engine.scheduler.make_stats() == per_step[-1]
    engine.add_request(make_request("again", 8, max_tokens=1))  # its first block is cached
    run_to_completion(engine)
    later = engine.scheduler.make_stats()
    assert later.num_preemptions == first.num_preemptions
    assert later.prefix_cache_queries == first.prefix_cache_queries + 8
    assert later.prefix_cache_hits == first.prefix_cache_hits + 4
    assert later == engine.scheduler.make_stats()


def test_add_request_refusals_name_the_field():
    from sparrow.errors import InvalidArgumentError

    engine, _ = make_engine(num_blocks=4, block_size=4)  # 16 tokens in all
    with pytest.raises(InvalidArgumentError) as info:  # the prompt fits, the output does not
        engine.add_request(make_request("long-output", 10, max_tokens=10))
    assert info.value.field == "max_tokens"
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request(make_request("long-prompt", 20, max_tokens=1))
    assert info.value.field == "prompt"
    engine.add_request(make_request("same", 4, max_tokens=1))
    with pytest.raises(InvalidArgumentError, match="already in use") as info:
        engine.add_request(make_request("same", 4, max_tokens=1))
    assert info.value.field == "request_id"


def test_a_subclass_can_replace_one_phase_of_schedule():
    from sparrow.core.kv_cache_manager import KVCacheManager
    from sparrow.core.request import Request
    from sparrow.core.sched.scheduler import Scheduler, StepPlan

    class RunningOnly(Scheduler):
        """Admits nothing new: only the waiting phase is replaced."""

        def _schedule_waiting(self, plan: StepPlan) -> None:
            self.seen_budget = plan.token_budget

    def build(cls):
        scheduler = cls(KVCacheManager(num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                        max_model_len=256)
        scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
        return scheduler

    paused = build(RunningOnly)
    output = paused.schedule()
    assert output.is_empty and [r.request_id for r in paused.waiting] == ["a"]
    assert paused.seen_budget == 64
    admitted = build(Scheduler).schedule()
    assert admitted.num_scheduled_tokens == {"a": 3} and admitted.total_num_scheduled_tokens == 3


def test_stats_readers_count_each_event_once():
    """Prometheus counters grow by the difference between snapshots (a snapshot seen twice, or an
    older one arriving late, adds nothing); data-parallel stats sum every core's latest."""
    from sparrow.engine.dp_client import combine_stats
    from sparrow.engine.metrics import EngineMetrics
    from sparrow.engine.stat_loggers import StatLoggerManager
    from sparrow.wire import SchedulerStats

    metrics = EngineMetrics("m")
    manager = StatLoggerManager([metrics], interval=10.0)
    snapshots = [SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1),
                 SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1),
                 SchedulerStats(prefix_cache_queries=30, prefix_cache_hits=12, num_preemptions=3),
                 SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1)]
    for stats in snapshots:
        manager.record(stats, None)
    counted = [metrics.registry.get_sample_value(f"sparrow:{name}_total", {"model_name": "m"})
               for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")]
    assert counted == [30, 12, 3]
    combined = combine_stats([SchedulerStats(num_preemptions=2, kv_connector_loaded_tokens=16, num_total_blocks=8),
                              SchedulerStats(num_preemptions=3, num_total_blocks=8, num_free_blocks=4)])
    assert (combined.num_preemptions, combined.kv_connector_loaded_tokens) == (5, 16)
    assert combined.kv_cache_usage == 0.75
