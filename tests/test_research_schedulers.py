"""The research scheduler policies (sjf, lpm, priority) through a real engine core.

Kernel tests run the engine core on the fake executor (the far side of the scheduler); the last
test drives each policy through ``LLM`` on a test model to check it end to end.
"""

from __future__ import annotations

import pytest

from sparrow import LLM, SamplingParams
from sparrow.engine.core import EngineCore
from tests.test_scheduler import make_engine, make_request, run_to_completion


def admission_order(executor) -> list[str]:
    """Request ids in the order they were first scheduled (resumptions after preemption excluded)."""
    return [new.req_id for so in executor.history for new in so.scheduled_new_reqs if not new.output_token_ids]


def finish_order(engine: EngineCore, max_steps: int = 10_000) -> list[str]:
    finished: list[str] = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        finished.extend(out.request_id for out in engine.step().outputs if out.finished)
    raise AssertionError("engine did not finish")


# -- shortest job first -----------------------------------------------------------------------
def test_sjf_finishes_short_requests_first_with_one_running_slot():
    engine, executor = make_engine(scheduler="sjf", max_num_seqs=1)
    # Arrival order is the reverse of job length (prompt + max_tokens).
    engine.add_request(make_request("long", 64, max_tokens=16, arrival_time=1.0))
    engine.add_request(make_request("medium", 32, max_tokens=8, arrival_time=2.0, start=200))
    engine.add_request(make_request("short", 8, max_tokens=2, arrival_time=3.0, start=400))
    assert finish_order(engine) == ["short", "medium", "long"]
    assert admission_order(executor) == ["short", "medium", "long"]


def test_fcfs_on_the_same_requests_keeps_arrival_order():
    engine, _ = make_engine(scheduler="fcfs", max_num_seqs=1)
    engine.add_request(make_request("long", 64, max_tokens=16, arrival_time=1.0))
    engine.add_request(make_request("medium", 32, max_tokens=8, arrival_time=2.0, start=200))
    engine.add_request(make_request("short", 8, max_tokens=2, arrival_time=3.0, start=400))
    assert finish_order(engine) == ["long", "medium", "short"]


def test_sjf_equal_jobs_keep_arrival_order():
    engine, executor = make_engine(scheduler="sjf", max_num_seqs=1)
    for index, name in enumerate(["a", "b", "c"]):
        engine.add_request(make_request(name, 10, max_tokens=2, arrival_time=float(index + 1), start=100 * index))
    run_to_completion(engine)
    assert admission_order(executor) == ["a", "b", "c"]


def test_sjf_preempts_the_longest_job_first():
    # 8 blocks of 4 tokens = 32 slots; the two requests grow to 22 and 20 tokens: one must yield.
    engine, executor = make_engine(num_blocks=8, block_size=4, scheduler="sjf", max_num_batched_tokens=64)
    engine.add_request(make_request("longer", 8, max_tokens=14, arrival_time=1.0))
    engine.add_request(make_request("shorter", 8, max_tokens=12, arrival_time=2.0, start=50))
    outputs = run_to_completion(engine)
    resumed = {new.req_id for so in executor.history for new in so.scheduled_new_reqs if new.output_token_ids}
    assert resumed == {"longer"}, "FCFS would preempt the later arrival; SJF preempts the longer job"
    assert len(outputs["longer"]) == 14 and len(outputs["shorter"]) == 12


# -- longest prefix match (cache-aware) -------------------------------------------------------
def lpm_scenario(scheduler: str, enable_prefix_caching: bool = True):
    """A finished request leaves a 64-token prefix in the cache; then a request without it
    ("cold", earlier) and one that starts with it ("hit", later) wait for a single slot."""
    engine, executor = make_engine(scheduler=scheduler, max_num_seqs=1, enable_prefix_caching=enable_prefix_caching)
    engine.add_request(make_request("warm", 64, max_tokens=1, start=100, arrival_time=0.5))
    run_to_completion(engine)
    engine.add_request(make_request("cold", 80, max_tokens=2, start=600, arrival_time=1.0))
    engine.add_request(make_request("hit", 80, max_tokens=2, start=100, arrival_time=2.0))  # warm's prompt + 16
    run_to_completion(engine)
    computed_at_admission = {new.req_id: new.num_computed_tokens for so in executor.history
                             for new in so.scheduled_new_reqs}
    return admission_order(executor)[1:], computed_at_admission


def test_lpm_admits_the_request_whose_prefix_is_cached_first():
    order, computed = lpm_scenario("lpm")
    assert order == ["hit", "cold"]
    assert computed["hit"] == 64 and computed["cold"] == 0


def test_fcfs_admits_the_earlier_cold_request_first():
    order, _ = lpm_scenario("fcfs")
    assert order == ["cold", "hit"]


def test_lpm_without_prefix_caching_falls_back_to_arrival_order():
    order, computed = lpm_scenario("lpm", enable_prefix_caching=False)
    assert order == ["cold", "hit"]
    assert computed["hit"] == 0


# -- priority ---------------------------------------------------------------------------------
def test_priority_admits_by_priority_then_arrival():
    engine, executor = make_engine(scheduler="priority", max_num_seqs=1)
    specs = [("p2", 2), ("p0-first", 0), ("p1", 1), ("p0-second", 0)]
    for index, (name, priority) in enumerate(specs):
        engine.add_request(make_request(name, 6, max_tokens=2, priority=priority,
                                        arrival_time=float(index + 1), start=100 * index))
    assert finish_order(engine) == ["p0-first", "p0-second", "p1", "p2"]
    assert admission_order(executor) == ["p0-first", "p0-second", "p1", "p2"]


# -- end to end through LLM -------------------------------------------------------------------
PROMPT_LENGTHS = [60, 30, 5]
MAX_TOKENS = [8, 4, 2]
PRIORITIES = [1, 2, 0]


@pytest.fixture(scope="module")
def llm_results(qwen3_dir):
    """scheduler -> (greedy token ids per prompt, prompt indices in finish order)."""
    prompts = [{"prompt_token_ids": [(7 * n + 3 * i) % 3000 + 1 for i in range(n)]} for n in PROMPT_LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    results = {}
    for scheduler in ("fcfs", "sjf", "priority", "lpm"):
        llm = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=256, num_kv_blocks=64,
                  scheduler=scheduler, max_num_seqs=1)
        try:
            # Only the priority policy reads priorities; the others refuse a non-zero one.
            outputs = llm.generate(prompts, params, use_tqdm=False,
                                   priority=PRIORITIES if scheduler == "priority" else None)
            if scheduler != "priority":
                with pytest.raises(ValueError, match=f"priority 1 of request .*the '{scheduler}' scheduler does not"):
                    llm.generate(prompts, params, use_tqdm=False, priority=PRIORITIES)
        finally:
            llm.shutdown()
        by_finish = sorted(range(len(outputs)), key=lambda i: outputs[i].metrics.finished_time)
        results[scheduler] = ([o.outputs[0].token_ids for o in outputs], by_finish)
    return results


def test_every_research_scheduler_runs_end_to_end_with_the_same_tokens(llm_results):
    reference, fcfs_order = llm_results["fcfs"]
    assert fcfs_order == [0, 1, 2]
    for scheduler, (tokens, _) in llm_results.items():
        assert tokens == reference, f"scheduler {scheduler!r} changed the greedy output"
        assert [len(t) for t in tokens] == MAX_TOKENS


def test_sjf_through_llm_finishes_shortest_jobs_first(llm_results):
    _, order = llm_results["sjf"]
    assert order == [2, 1, 0]


def test_priority_through_llm_finishes_in_priority_order(llm_results):
    _, order = llm_results["priority"]
    assert order == [2, 0, 1]
