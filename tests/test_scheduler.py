"""Scheduler and engine-core behaviour against a fake executor (the far side of the unit)."""

from __future__ import annotations

import pytest

from sparrow.config import EngineConfig
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
