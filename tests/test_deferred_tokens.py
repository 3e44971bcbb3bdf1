"""Overlapped scheduling's device-side token feed (sparrow.worker.deferred_tokens): the worker does
not wait for a step's sampled tokens; the next step reads them on the device, and the host state
gets them once that step's forward is enqueued.

The reference is the synchronous engine on the same model: every path of the feed (the steady
batch's slice copy, the gather when rows moved, the host fallback when a pending request is left
out of the next step) must give its tokens, logprobs and finish reasons.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.wire import CachedRequestData, NewRequestData, SchedulerOutput
from sparrow.worker.deferred_tokens import PendingTokens
from sparrow.worker.input_batch import CachedRequestState, InputBatch
from tests.test_async_scheduling import UNDER_PRESSURE, assert_same, mixed_batch, summary, synchronous_reference


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("separate_device,host_only", [(False, False), (True, False), (False, True)],
                         ids=["zero_copy", "copied_inputs", "host_path"])
def test_fed_tokens_equal_the_synchronous_engine_on_every_path(separate_device, host_only, monkeypatch):
    prompts, params = mixed_batch()
    reference = synchronous_reference()  # one synchronous run for the three paths (and test_async_scheduling)
    if host_only:  # every step after a deferred one settles its tokens first
        monkeypatch.setattr(PendingTokens, "continues_in", lambda self, so: False)
    with LLM(async_scheduling=True, multiprocess=False, **UNDER_PRESSURE) as llm:
        runner = runner_of(llm)
        runner.separate_device_buffers = separate_device  # the copying path of a GPU, on the CPU
        runner._input_buffers = None
        got = [summary(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        counts = dict(runner.feed_counts)
        assert runner.input_buffers().separate_device == separate_device
    for index, (want, have) in enumerate(zip(reference, got)):
        assert_same(have, want, f"request {index} differs with the device-side feed")
    if host_only:
        assert set(counts) == {"host"}, counts
    else:  # requests finishing or preempted move rows (the gather); steady decode: the slice copy
        assert counts.get("identity", 0) > 0 and counts.get("indexed", 0) > 0, counts


@pytest.mark.cuda
def test_fed_tokens_on_a_gpu_equal_the_synchronous_engine():
    """On a GPU the tokens travel through the pinned ring and its events, the indices of a gather
    through pinned staging: the same request mix, overlapped and not, CUDA graphs on."""
    prompts, params = mixed_batch()
    engine_args = dict(max_num_batched_tokens=48, num_kv_blocks=30, enable_prefix_caching=True, multiprocess=False,
                       device="cuda", dtype="float32")
    with LLM(async_scheduling=False, **engine_args) as llm:
        reference = [summary(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(async_scheduling=True, **engine_args) as llm:
        got = [summary(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        counts = dict(runner_of(llm).feed_counts)
    for index, (want, have) in enumerate(zip(reference, got)):
        assert_same(have, want, f"request {index} differs with the device-side feed on the GPU")
    assert counts.get("identity", 0) > 0 and counts.get("indexed", 0) > 0, counts


def test_a_plugin_step_hook_gets_plain_outputs():
    """A plugin that wraps sparrow_execute_model is handed ModelRunnerOutputs it can read, as
    without overlap: the deferred path is only taken with the kernel's own step."""
    from sparrow.hookspecs import hookimpl
    from sparrow.wire import ModelRunnerOutput
    from tests.test_hooks import registered

    seen = []

    class Wrap:
        @hookimpl(hookwrapper=True)
        def sparrow_execute_model(self, worker, scheduler_output):
            outcome = yield
            seen.append(type(outcome.get_result()))

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with registered(Wrap(), "wrap-step"):
        with LLM(multiprocess=False, async_scheduling=True) as llm:
            wrapped = llm.generate(["a b c", "d e"], params, use_tqdm=False)
            assert not runner_of(llm).feed_counts
    with LLM(multiprocess=False) as llm:
        plain = llm.generate(["a b c", "d e"], params, use_tqdm=False)
    assert seen and set(seen) == {ModelRunnerOutput}
    assert [o.outputs[0].token_ids for o in wrapped] == [o.outputs[0].token_ids for o in plain]


# -- PendingTokens on a hand-made batch ---------------------------------------------------------

def state(req_id: str, outputs: list[int]) -> CachedRequestState:
    return CachedRequestState(req_id=req_id, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(),
                              block_ids=[0], num_computed_tokens=3 + len(outputs), output_token_ids=list(outputs))


def step(num_scheduled: dict[str, int], finished: set[str] = frozenset(), new: tuple[str, ...] = ()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req_id=r, prompt_token_ids=[1], sampling_params=SamplingParams(),
                                           block_ids=[0], num_computed_tokens=0) for r in new],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()), finished_req_ids=sorted(finished))


def test_pending_tokens_continue_feed_and_settle():
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_num_blocks_per_req=2)
    a, b, c = state("a", [7]), state("b", []), state("c", [9, 9])
    for s in (a, b, c):
        batch.add(s)
    # Step n sampled 40 for row 0 (a) and 42 for row 2 (c); b was a partial prefill.
    pending = PendingTokens(torch.tensor([40, 41, 42]), torch.tensor([40, 41, 42]), None, [a, c], np.array([0, 2]))

    assert pending.continues_in(step({"a": 1, "c": 1, "b": 5}))
    assert pending.continues_in(step({"c": 1}, finished={"a"}))  # a finished: its token is dropped
    assert pending.continues_in(step({"a": 4, "c": 1}, new=("a",)))  # a resumed with a new state
    assert pending.continues_in(step({"c": 1, "b": 1}))  # a left out: settled before it returns
    assert not pending.continues_in(step({"a": 2, "c": 1}))  # more than its pending token
    assert not pending.continues_in(step({}))

    # a leaves; c moves into row 0. Step n+1: c (1 token) then b (3 tokens).
    batch.remove("a")
    assert batch.req_ids == ["c", "b"]
    input_ids = torch.zeros(4, dtype=torch.int64)
    assert pending.feed(batch, input_ids, np.array([0, 1, 4]), torch.from_numpy) == "indexed"
    assert input_ids.tolist() == [42, 0, 0, 0]
    pending.settle(batch)
    assert a.output_token_ids == [7, 40] and c.output_token_ids == [9, 9, 42] and b.output_token_ids == []
    assert batch.token_ids[0, :6].tolist() == [1, 2, 3, 9, 9, 42] and batch.num_tokens[0] == 6

    # A steady batch: the same rows in the same order take one slice copy.
    steady = PendingTokens(torch.tensor([5, 6]), torch.tensor([5, 6]), None, [c, b], np.array([0, 1]))
    input_ids = torch.zeros(2, dtype=torch.int64)
    assert steady.feed(batch, input_ids, np.array([0, 1, 2]), torch.from_numpy) == "identity"
    assert input_ids.tolist() == [5, 6]
