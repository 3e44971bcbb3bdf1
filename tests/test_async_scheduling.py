"""Overlapped (async) scheduling: step n+1 is scheduled while step n runs, on the CPU too.

The reference is the same engine without overlap: greedy and seeded tokens, logprobs, stops and
finish reasons must be identical, with chunked prefill, prefix caching and preemption forced.
"""

from __future__ import annotations

import functools
import json
import random

import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError
from sparrow.core.kv_cache_manager import KVCacheManager
from sparrow.core.request import Request, RequestStatus
from sparrow.core.sched.scheduler import Scheduler
from sparrow.sampling_params import StructuredOutputsParams
from sparrow.wire import ModelRunnerOutput


def mixed_batch() -> tuple[list, list[SamplingParams]]:
    """Prompts sharing prefixes (prefix-cache hits), long ones (chunked prefill), and a mix of
    greedy, seeded, logprobs, stop-token and max_tokens settings."""
    rng = random.Random(3)
    shared = [rng.randrange(5, 4000) for _ in range(40)]
    prompts: list = [{"prompt_token_ids": shared + [rng.randrange(5, 4000) for _ in range(rng.randrange(3, 30))]}
                     for _ in range(6)]
    prompts += [{"prompt_token_ids": [rng.randrange(5, 4000) for _ in range(rng.randrange(60, 140))]}
                for _ in range(4)]
    prompts += ["The weather today is", "Once upon a time there was"]
    params = []
    for index in range(len(prompts)):
        kind = index % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=9 + index, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + index, max_tokens=12 + index,
                                         ignore_eos=True, logprobs=2))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=30, logprobs=1))
        else:
            params.append(SamplingParams(temperature=1.0, seed=7 * index, max_tokens=25, top_k=20,
                                         repetition_penalty=1.2))
    return prompts, params


def run(async_scheduling: bool, prompts, params, **engine_args) -> tuple[list, int]:
    llm = LLM(multiprocess=False, async_scheduling=async_scheduling, **engine_args)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        return [summary(o) for o in outputs], scheduler.num_preemptions
    finally:
        llm.shutdown()


# A small token budget chunks the long prompts; 30 blocks of 16 tokens cannot hold mixed_batch(),
# so requests are preempted, and some while their previous step is still in flight.
UNDER_PRESSURE = dict(max_num_batched_tokens=48, num_kv_blocks=30, enable_prefix_caching=True)


@functools.lru_cache(maxsize=1)
def synchronous_reference() -> tuple[tuple, ...]:
    """The synchronous engine's summaries of mixed_batch() under UNDER_PRESSURE: the reference of
    this module and of tests/test_deferred_tokens.py, computed once per process (it is
    deterministic: greedy or seeded requests only)."""
    prompts, params = mixed_batch()
    return tuple(run(False, prompts, params, **UNDER_PRESSURE)[0])


def summary(output) -> tuple:
    completion = output.outputs[0]
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [{token: lp.logprob for token, lp in step.items()} for step in completion.logprobs]
    return tuple(completion.token_ids), completion.text, completion.finish_reason, logprobs


def assert_same(got: tuple, want: tuple, what: str) -> None:
    """Tokens, text and finish reason equal; logprobs of the same tokens within 1e-4 (a step's
    batch differs between the two engines, and float sums with it)."""
    assert got[:3] == want[:3], what
    if want[3] is None:
        assert got[3] is None, what
        return
    assert len(got[3]) == len(want[3]), what
    for got_step, want_step in zip(got[3], want[3]):
        assert got_step.keys() == want_step.keys(), what
        assert all(abs(got_step[t] - want_step[t]) < 1e-4 for t in want_step), what


def test_overlapped_tokens_equal_the_synchronous_engine_under_pressure():
    prompts, params = mixed_batch()
    reference = synchronous_reference()
    overlapped, preemptions = run(True, prompts, params, **UNDER_PRESSURE)
    assert preemptions > 0
    for index, (want, got) in enumerate(zip(reference, overlapped)):
        assert_same(got, want, f"request {index} differs with async_scheduling")
    # Every request stopped where it should: max_tokens, never a token past it.
    for (token_ids, _, reason, _), sampling in zip(overlapped, params):
        assert len(token_ids) <= sampling.max_tokens
        assert reason in ("length", "stop")


def test_overlapped_engine_process_and_stop_strings():
    """The default engine-core process (its busy loop keeps collecting steps in flight after the
    last request finished) and a stop string that ends requests while the next step runs."""
    prompts = [f"Question {i}: what comes next?" for i in range(6)]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(async_scheduling=True) as llm:
        first = llm.generate(prompts, free, use_tqdm=False)
        stops = [o.outputs[0].text[4:7] for o in first]
        stopped = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[s])
                                         for s in stops], use_tqdm=False)
        again = llm.generate(prompts, free, use_tqdm=False)
    # The reference is the synchronous engine; in this process, which gives the same tokens as
    # its engine-core process without starting one.
    with LLM(async_scheduling=False, multiprocess=False) as llm:
        reference = llm.generate(prompts, free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in reference]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in reference]
    for out, stop, full in zip(stopped, stops, first):
        assert out.outputs[0].finish_reason == "stop"
        assert stop not in out.outputs[0].text
        assert full.outputs[0].text.startswith(out.outputs[0].text)


def test_structured_requests_run_in_turn_beside_overlapped_ones():
    """A grammar's mask for the next token needs the token in flight: while a constrained request
    is unfinished the engine schedules one step at a time, and its output is valid JSON."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
              "additionalProperties": False}
    constrained = SamplingParams(temperature=0.0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = ["Give me a number:", "Tell a story", "Another one:"]
    params = [constrained, free, free]
    with LLM(multiprocess=False, async_scheduling=True) as llm:
        core = llm.llm_engine.engine_core.engine_core
        may_overlap = []
        schedule_step = core._schedule_step

        def watched():
            may_overlap.append((core.scheduler.num_structured_requests, core._may_schedule_ahead()))
            return schedule_step()

        core._schedule_step = watched
        overlapped = llm.generate(prompts, params, use_tqdm=False)
        # The scheduler's count of requests with a grammar decides, and drops to 0 when they finish.
        assert (1, False) in may_overlap and core.scheduler.num_structured_requests == 0
        assert all(ok == (count == 0) for count, ok in may_overlap)
        assert core.scheduler.requests == {}
    with LLM(multiprocess=False, async_scheduling=False) as llm:
        reference = llm.generate(prompts, params, use_tqdm=False)
    assert json.loads(overlapped[0].outputs[0].text)["answer"] in ("yes", "no", "maybe")
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in reference]


def test_abort_while_steps_are_in_flight_leaves_the_engine_usable():
    llm = LLM(multiprocess=False, async_scheduling=True)
    try:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        for index in range(4):
            engine.add_request(str(index), f"Prompt number {index}", params)
        finished: dict[str, tuple] = {}
        core = engine.engine_core.engine_core
        for _ in range(3):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = tuple(out.outputs[0].token_ids)
            assert len(core._in_flight) == 1  # the next step was started before this one was collected
        engine.abort_request(["1", "2"])
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = (out.outputs[0].finish_reason, len(out.outputs[0].token_ids))
        assert finished["0"] == ("length", 30) and finished["3"] == ("length", 30)
        assert not core.has_unfinished_requests() and core.kv_cache_manager.usage == 0.0
        # Still right afterwards.
        alone = llm.generate("Prompt number 0", params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    with LLM(multiprocess=False) as reference:
        assert reference.generate("Prompt number 0", params, use_tqdm=False)[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("extra, problem", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
    ({"kv_connector": "shared_storage", "kv_role": "kv_both"}, "KV connector"),
])
def test_configurations_that_cannot_overlap_are_refused_naming_the_field(extra, problem):
    with pytest.raises(ConfigError, match="async_scheduling") as info:
        LLM(async_scheduling=True, **extra)
    assert problem in str(info.value)


def test_tensor_parallel_ranks_overlap_too():
    """With worker processes, step n+1 is sent to the ranks before step n's output is read; each
    rank feeds its own sampled tokens forward on its device, and rank 0 sends a step's output
    when it is ready or once the next step is launched."""
    prompts = [f"Tensor parallel prompt {i}" for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(5)]
    mixed_prompts, mixed_params = mixed_batch()
    with LLM(multiprocess=False, tensor_parallel_size=2, async_scheduling=True) as llm:
        overlapped = llm.generate(prompts, params, use_tqdm=False)
        mixed = [summary(o) for o in llm.generate(mixed_prompts, mixed_params, use_tqdm=False)]
        executor = llm.llm_engine.engine_core.engine_core.executor
        assert executor._pending == {}
        counts = executor.collective_rpc("feed_counts")
        assert all(c.get("identity", 0) > 0 and c.get("indexed", 0) > 0 for c in counts), counts
    with LLM(multiprocess=False) as llm:
        reference = llm.generate(prompts, params, use_tqdm=False)
    with LLM(multiprocess=False, tensor_parallel_size=2) as llm:
        mixed_reference = [summary(o) for o in llm.generate(mixed_prompts, mixed_params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in reference]
    for index, (want, got) in enumerate(zip(mixed_reference, mixed)):
        assert_same(got, want, f"request {index} differs with tensor-parallel overlap")


# -- the scheduler alone: placeholders --------------------------------------------------------
def make_scheduler(num_blocks: int = 64) -> Scheduler:
    manager = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_caching=True, max_num_batched_tokens=64)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    scheduler.async_scheduling = True
    return scheduler


def sampled_output(scheduler_output, token: int) -> ModelRunnerOutput:
    """Every scheduled request that completed its tokens samples ``token``."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[token] for _ in req_ids])


def test_placeholders_let_the_next_step_be_scheduled_and_stop_at_max_tokens():
    scheduler = make_scheduler()
    request = Request("r", list(range(10, 20)), SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add_request(request)
    first = scheduler.schedule()  # the prompt; samples output token 1
    assert first.num_scheduled_tokens == {"r": 10} and request.num_output_placeholders == 1
    second = scheduler.schedule()  # before the first's token is back: one token, its position 10
    assert second.num_scheduled_tokens == {"r": 1} and request.num_output_placeholders == 2
    third = scheduler.schedule()  # output token 3 of 3
    assert third.num_scheduled_tokens == {"r": 1} and request.num_output_placeholders == 3
    # Three tokens are in flight, max_tokens=3: nothing more is scheduled for it.
    assert scheduler.schedule().total_num_scheduled_tokens == 0
    outputs = [scheduler.update_from_output(step, sampled_output(step, 7 + i))
               for i, step in enumerate((first, second, third))]
    assert [o[0].new_token_ids for o in outputs] == [[7], [8], [9]]
    assert outputs[-1][0].finish_reason is not None and "r" not in scheduler.requests
    assert request.num_output_placeholders == 0


def test_a_request_finishing_while_its_next_step_runs_is_dropped_from_that_step():
    scheduler = make_scheduler()
    eos = 2
    request = Request("r", list(range(10, 18)), SamplingParams(max_tokens=10), eos_token_id=eos)
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    done = scheduler.update_from_output(first, sampled_output(first, eos))
    assert done[0].finish_reason is not None and request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.update_from_output(second, sampled_output(second, 5)) == []  # its extra token is dropped
    assert scheduler.kv_cache_manager.usage == 0.0 and "r" in scheduler.schedule().finished_req_ids


def test_a_request_preempted_while_its_step_runs_gets_its_token_then_resumes():
    scheduler = make_scheduler(num_blocks=7)  # 6 usable blocks of 4 tokens
    a = Request("a", list(range(10, 18)), SamplingParams(max_tokens=20, ignore_eos=True))
    b = Request("b", list(range(30, 38)), SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()  # both prompts: 2 blocks each, 4 of 6
    assert first.num_scheduled_tokens == {"a": 8, "b": 8}
    in_flight = [first]
    preempted_with_placeholder = False
    token = 100
    for _ in range(12):
        step = scheduler.schedule()
        if b.status == RequestStatus.PREEMPTED and b.num_output_placeholders:
            preempted_with_placeholder = True
        in_flight.append(step)
        oldest = in_flight.pop(0)
        token += 1
        scheduler.update_from_output(oldest, sampled_output(oldest, token))
        assert b.num_output_placeholders <= 2
    assert preempted_with_placeholder
    # b kept the token of the step that was running when it was preempted, and no placeholder is left.
    assert b.num_output_tokens >= 1 and all(r.num_output_placeholders <= 2 for r in scheduler.requests.values())
