"""AsyncLLM as a vLLM user embeds it in an asyncio service: the real built-in model (sparrow-tiny)
in a real engine-core process. Bad input fails its own request with the field named, never the
engine or the other streams; cancelled and aborted streams end; shutdown and a killed engine core
end every stream with EngineDeadError instead of leaving it hanging.

Timeouts here are generous "does not hang" bounds, never performance assertions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from sparrow import AsyncLLM, RequestOutputKind, SamplingParams
from sparrow.config import ConfigError, EngineConfig
from sparrow.engine.async_llm import AsyncEngineArgs
from sparrow.engine.exceptions import EngineDeadError
from sparrow.errors import InvalidArgumentError

HANG_S = 60  # "does not hang": far beyond what any of these takes on a loaded CI machine


def run(body, **engine_args):
    """Build an AsyncLLM with the built-in model, run ``body(engine)`` in one event loop, shut down."""

    async def main():
        engine = AsyncLLM.from_engine_args(model=None, **engine_args)
        try:
            return await asyncio.wait_for(body(engine), HANG_S * 3)
        finally:
            engine.shutdown()

    return asyncio.run(main())


async def collect(engine, prompt, params, request_id, **kwargs):
    return [output async for output in engine.generate(prompt, params, request_id, **kwargs)]


def long_params(kind=RequestOutputKind.CUMULATIVE, **kwargs):
    return SamplingParams(max_tokens=1500, ignore_eos=True, output_kind=kind, **kwargs)


async def started(engine, prompt, params, request_id):
    """A consumer task of a long request, returned once its first output arrived (or, for
    FINAL_ONLY, once the engine core runs it). The task returns its outputs, or the exception."""
    outputs: list = []

    async def consume():
        try:
            async for output in engine.generate(prompt, params, request_id):
                outputs.append(output)
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            return exc
        return outputs

    task = asyncio.create_task(consume())
    deadline = time.monotonic() + HANG_S
    while not outputs:
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            stats = await engine.get_scheduler_stats()
            if stats.num_running_reqs:
                break
        assert time.monotonic() < deadline and not task.done(), "the request never started"
        await asyncio.sleep(0.01)
    return task, outputs


def test_constructors_follow_vllm():
    args = AsyncEngineArgs(model=None, max_model_len=256)
    assert args.max_model_len == 256 and args.seed == 0  # unset names read as their defaults
    args.max_num_seqs = 8
    assert args.create_engine_config().scheduler.max_num_seqs == 8
    with pytest.raises(ConfigError, match="max_modle_len"):
        AsyncEngineArgs(model=None, max_modle_len=256)
    with pytest.raises(ConfigError, match="max_num_seq"):
        args.max_num_seq = 4
    with pytest.raises(TypeError, match="config"):
        AsyncLLM()  # type: ignore[call-arg]  # as in vLLM: a whole configuration, or from_engine_args
    with pytest.raises(TypeError, match="EngineConfig"):
        AsyncLLM({"model": None})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not both"):
        AsyncLLM.from_engine_args(args, max_model_len=128)
    with pytest.raises(TypeError, match="AsyncEngineArgs or an EngineConfig"):
        AsyncLLM.from_engine_args("sparrow-tiny")  # type: ignore[arg-type]

    async def build_and_generate(make):
        engine = make()
        try:
            assert await engine.get_supported_tasks() == ("generate",)
            assert (await engine.get_model_config()).max_model_len == 256
            assert isinstance(await engine.get_vllm_config(), EngineConfig)
            outputs = await collect(engine, "hi", SamplingParams(max_tokens=2, ignore_eos=True), "r")
            return outputs[-1].finished
        finally:
            engine.shutdown()

    assert asyncio.run(build_and_generate(lambda: AsyncLLM.from_engine_args(AsyncEngineArgs(max_model_len=256))))
    config = EngineConfig.from_kwargs(model=None, max_model_len=256)
    assert asyncio.run(build_and_generate(lambda: AsyncLLM.from_vllm_config(config)))


def test_output_kinds_for_one_and_two_samples():
    async def body(engine):
        results = {}
        for n in (1, 2):
            for kind in RequestOutputKind:
                params = SamplingParams(max_tokens=6, ignore_eos=True, n=n, seed=7, temperature=1.0, output_kind=kind)
                results[n, kind] = await collect(engine, "The sparrow", params, f"{n}-{kind.name}")
        return results

    results = run(body)
    for n in (1, 2):
        cumulative = results[n, RequestOutputKind.CUMULATIVE]
        delta = results[n, RequestOutputKind.DELTA]
        final_only = results[n, RequestOutputKind.FINAL_ONLY]
        for outputs in (cumulative, delta, final_only):
            assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert len(final_only) == 1
        final = {c.index: c for c in final_only[0].outputs}
        assert sorted(final) == list(range(n))
        assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in final.values())
        # CUMULATIVE: every output holds everything so far; the last one equals FINAL_ONLY's.
        assert {c.index: (c.token_ids, c.text) for c in cumulative[-1].outputs} == \
            {i: (c.token_ids, c.text) for i, c in final.items()}
        for earlier, later in zip(cumulative, cumulative[1:]):
            for a, b in zip(earlier.outputs, later.outputs):
                assert b.token_ids[:len(a.token_ids)] == a.token_ids
        # DELTA: only what is new; concatenated, the same tokens and text.
        for index, completion in final.items():
            pieces = [c for o in delta for c in o.outputs if c.index == index]
            assert [t for c in pieces for t in c.token_ids] == completion.token_ids
            assert "".join(c.text for c in pieces) == completion.text


def test_many_concurrent_requests_with_different_params():
    async def body(engine):
        async def one(i):
            params = SamplingParams(max_tokens=3 + i % 5, ignore_eos=True, temperature=(i % 3) / 2, seed=i,
                                    n=1 + i % 2, output_kind=list(RequestOutputKind)[i % 3])
            return i, await collect(engine, f"prompt number {i}", params, f"c{i}")

        results = await asyncio.gather(*(one(i) for i in range(24)))
        return results, engine.output_processor.get_num_unfinished_requests(), dict(engine._collectors)

    results, unfinished, collectors = run(body)
    for i, outputs in results:
        assert all(o.request_id == f"c{i}" for o in outputs) and outputs[-1].finished
        delta = i % 3 == RequestOutputKind.DELTA
        lengths: dict[int, int] = {}
        for output in outputs if delta else outputs[-1:]:
            for c in output.outputs:
                lengths[c.index] = lengths.get(c.index, 0) + len(c.token_ids)
        assert lengths == {index: 3 + i % 5 for index in range(1 + i % 2)}
    assert unfinished == 0 and collectors == {}


def test_cancelled_consumer_is_aborted_and_the_others_go_on():
    async def body(engine):
        neighbour = asyncio.create_task(collect(engine, "neighbour", SamplingParams(max_tokens=40, ignore_eos=True),
                                                "neighbour"))
        victim, _ = await started(engine, "victim", long_params(), "victim")
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert "victim" not in engine._collectors
        neighbour_outputs = await asyncio.wait_for(neighbour, HANG_S)
        # Leaving an `async for` early aborts too (the generator is closed when collected).
        async for _ in engine.generate("breaker", long_params(), "breaker"):
            break
        for _ in range(HANG_S * 10):
            if (await engine.get_scheduler_stats()).num_running_reqs == 0 and not engine._collectors:
                break
            await asyncio.sleep(0.1)
        info = await engine.get_kv_cache_info()
        return neighbour_outputs, info, (await engine.get_scheduler_stats()).num_running_reqs

    neighbour_outputs, info, running = run(body, num_kv_blocks=256)
    assert neighbour_outputs[-1].finished and len(neighbour_outputs[-1].outputs[0].token_ids) == 40
    assert running == 0 and info["num_free_blocks"] == info["num_blocks"]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_abort_by_id_ends_the_stream_with_finish_reason_abort(kind):
    async def body(engine):
        task, _ = await started(engine, "abort me", long_params(kind, n=2), "victim")
        await engine.abort("victim")
        outputs = await asyncio.wait_for(task, HANG_S)
        await engine.abort(["victim", "never-existed"])  # finished or unknown ids are ignored
        await engine.abort(iter(()))
        with pytest.raises(InvalidArgumentError) as info:
            await engine.abort([7])  # type: ignore[list-item]
        assert info.value.field == "request_id"
        return outputs

    outputs = run(body)
    assert not isinstance(outputs, Exception)
    assert outputs[-1].finished
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    assert {c.finish_reason for c in outputs[-1].outputs} == {"abort"}


def test_duplicate_request_ids_are_refused_to_the_second_caller():
    async def body(engine):
        first, _ = await started(engine, "first", long_params(), "dup")
        with pytest.raises(InvalidArgumentError, match="already in use") as info:
            await collect(engine, "second", SamplingParams(max_tokens=2), "dup")
        assert info.value.field == "request_id"
        # "0_dup" is the id of the first sample of an n=2 request "dup"... and vice versa.
        parent, _ = await started(engine, "parent", long_params(n=2), "p")
        with pytest.raises(InvalidArgumentError, match="already in use") as info:
            await collect(engine, "child id", SamplingParams(max_tokens=2), "0_p")
        assert info.value.field == "request_id"
        # Two callers racing for one id: exactly one gets it.
        results = await asyncio.gather(collect(engine, "a", SamplingParams(max_tokens=2), "race"),
                                       collect(engine, "b", SamplingParams(max_tokens=2), "race"),
                                       return_exceptions=True)
        await engine.abort(["dup", "p"])
        return await first, await parent, results

    first, parent, results = run(body)
    assert first[-1].outputs[0].finish_reason == "abort" and parent[-1].finished
    assert sorted(type(r).__name__ for r in results) == ["InvalidArgumentError", "list"]


def _mutated(**fields):
    params = SamplingParams(max_tokens=4)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


BAD_REQUESTS = {
    # label: (prompt, params, request_id, keyword arguments, the field the error names)
    "request_id int": ("x", SamplingParams(max_tokens=2), 123, {}, "request_id"),
    "request_id None": ("x", SamplingParams(max_tokens=2), None, {}, "request_id"),
    "request_id empty": ("x", SamplingParams(max_tokens=2), "", {}, "request_id"),
    "max_tokens -1 set after construction": ("x", _mutated(max_tokens=-1), "r", {}, "max_tokens"),
    "temperature str set after construction": ("x", _mutated(temperature="hot"), "r", {}, "temperature"),
    "output_kind str set after construction": ("x", _mutated(output_kind="DELTA"), "r", {}, "output_kind"),
    "params a dict": ("x", {"max_tokens": 2}, "r", {}, "sampling_params"),
    "prompt None": (None, SamplingParams(max_tokens=2), "r", {}, "prompt"),
    "prompt dict with an empty cache_salt": ({"prompt": "x", "cache_salt": ""}, SamplingParams(max_tokens=2), "r",
                                             {}, "cache_salt"),
    "prompt dict with an int cache_salt": ({"prompt": "x", "cache_salt": 7}, SamplingParams(max_tokens=2), "r", {},
                                           "cache_salt"),
    "prompt dict with multi_modal_data": ({"prompt": "x", "multi_modal_data": {"image": 1}},
                                          SamplingParams(max_tokens=2), "r", {}, "prompt.multi_modal_data"),
    "priority str": ("x", SamplingParams(max_tokens=2), "r", {"priority": "high"}, "priority"),
    "priority float": ("x", SamplingParams(max_tokens=2), "r", {"priority": 1.5}, "priority"),
    "priority bool": ("x", SamplingParams(max_tokens=2), "r", {"priority": True}, "priority"),
    "priority beyond int64": ("x", SamplingParams(max_tokens=2), "r", {"priority": 2**70}, "priority"),
    "priority under fcfs": ("x", SamplingParams(max_tokens=2), "r", {"priority": 1}, "priority"),
    "lora_request str": ("x", SamplingParams(max_tokens=2), "r", {"lora_request": "adapter"}, "lora_request"),
    "trace_headers": ("x", SamplingParams(max_tokens=2), "r", {"trace_headers": {"traceparent": "00-1"}},
                      "trace_headers"),
    "tokenization_kwargs": ("x", SamplingParams(max_tokens=2), "r", {"tokenization_kwargs": {"truncation": True}},
                            "tokenization_kwargs"),
    "data_parallel_rank out of range": ("x", SamplingParams(max_tokens=2), "r", {"data_parallel_rank": 1},
                                        "data_parallel_rank"),
    "max_tokens beyond max_model_len": ("x", SamplingParams(max_tokens=10**6), "r", {}, "max_tokens"),
}


def test_bad_input_fails_only_its_own_request_and_names_the_field():
    async def body(engine):
        neighbour, neighbour_outputs = await started(
            engine, "neighbour", SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA),
            "neighbour")
        failures = {}
        for label, (prompt, params, request_id, kwargs, _) in BAD_REQUESTS.items():
            try:
                await asyncio.wait_for(collect(engine, prompt, params, request_id, **kwargs), HANG_S)
            except ValueError as exc:
                failures[label] = exc
            assert not engine.errored, f"{label} killed the engine: {engine.dead_error}"
        with pytest.raises(TypeError, match="foo"):
            await collect(engine, "x", SamplingParams(max_tokens=2), "r", foo=1)
        with pytest.raises(InvalidArgumentError, match="arrival_time") as info:
            await engine.add_request("r", "x", SamplingParams(max_tokens=2), arrival_time="now")
        failures["arrival_time"] = info.value
        for adapter in (None, "adapter"):
            with pytest.raises(InvalidArgumentError) as info:
                await engine.add_lora(adapter)
            assert info.value.field == "lora_request"
        with pytest.raises(InvalidArgumentError, match="pooling"):
            async for _ in engine.encode("x", None, "e"):
                pass
        # What asks for nothing is taken: vLLM's defaults, numpy integers, the one rank of one engine.
        import numpy as np

        fine = await collect(engine, "x", SamplingParams(max_tokens=2, ignore_eos=True), "fine",
                             trace_headers=None, tokenization_kwargs=None, data_parallel_rank=0,
                             priority=np.int64(0), lora_request=None)
        neighbour_result = await asyncio.wait_for(neighbour, HANG_S)
        return failures, fine, neighbour_result, neighbour_outputs

    failures, fine, neighbour_result, neighbour_outputs = run(body)
    expected = {label: case[4] for label, case in BAD_REQUESTS.items()} | {"arrival_time": "arrival_time"}
    assert {label: getattr(exc, "field", None) for label, exc in failures.items()} == expected
    for label, exc in failures.items():
        assert isinstance(exc, InvalidArgumentError), (label, exc)
    assert fine[-1].finished
    assert not isinstance(neighbour_result, Exception)
    assert sum(len(o.outputs[0].token_ids) for o in neighbour_outputs) == 200


def test_priority_types_under_the_priority_scheduler():
    async def body(engine):
        with pytest.raises(InvalidArgumentError) as info:
            await collect(engine, "x", SamplingParams(max_tokens=2), "r", priority="1")
        assert info.value.field == "priority"
        import numpy as np

        outputs = await collect(engine, "x", SamplingParams(max_tokens=2, ignore_eos=True), "r", priority=np.int32(-3))
        return outputs[-1].finished, engine.errored

    assert run(body, scheduler="priority") == (True, False)


def test_a_changed_sampling_params_does_not_change_a_running_request():
    async def body(engine):
        params = SamplingParams(max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        task = asyncio.create_task(collect(engine, "x", params, "r"))
        await asyncio.sleep(0)
        params.max_tokens = 1000
        params.output_kind = RequestOutputKind.DELTA
        return await asyncio.wait_for(task, HANG_S)

    outputs = run(body)
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 5


def test_shutdown_while_streaming_ends_every_stream_with_engine_dead_error():
    async def body(engine):
        tasks = [(await started(engine, f"p{i}", long_params(kind), f"s{i}"))[0]
                 for i, kind in enumerate(RequestOutputKind)]
        # Prompts still waiting for the input thread fail with the same error, not CancelledError.
        original = engine.input_processor.process_inputs

        def slow(*args, **kwargs):
            time.sleep(0.3)
            return original(*args, **kwargs)

        engine.input_processor.process_inputs = slow
        queued = [asyncio.create_task(collect(engine, "q", SamplingParams(max_tokens=2), f"q{i}")) for i in range(3)]
        await asyncio.sleep(0.1)
        engine.shutdown()
        results = await asyncio.wait_for(asyncio.gather(*tasks, *queued, return_exceptions=True), HANG_S)
        engine.shutdown()  # idempotent
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", SamplingParams(max_tokens=2), "late")
        with pytest.raises(EngineDeadError):
            await engine.reset_prefix_cache()
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        return results, engine.errored, engine.is_running

    results, errored, is_running = run(body)
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert errored and not is_running


def test_shutdown_from_another_thread_ends_the_streams():
    async def body(engine):
        task, _ = await started(engine, "p", long_params(RequestOutputKind.DELTA), "s")
        thread = threading.Thread(target=engine.shutdown)
        thread.start()
        result = await asyncio.wait_for(task, HANG_S)
        thread.join(HANG_S)
        return result

    assert isinstance(run(body), EngineDeadError)


def test_a_killed_engine_core_fails_every_stream_and_later_call():
    async def body(engine):
        tasks = [(await started(engine, f"p{i}", long_params(kind), f"s{i}"))[0]
                 for i, kind in enumerate(RequestOutputKind)]
        os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), HANG_S)
        assert engine.errored and not engine.is_running and isinstance(engine.dead_error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(engine, "late", SamplingParams(max_tokens=2), "late"), HANG_S)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.get_kv_cache_info(), HANG_S)
        return results

    results = run(body)
    assert all(isinstance(r, EngineDeadError) for r in results), results


def test_a_killed_idle_engine_core_is_noticed():
    async def body(engine):
        await engine.check_health()
        os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
        error = await asyncio.wait_for(engine.wait_until_dead(), HANG_S)
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", SamplingParams(max_tokens=2), "late")
        return error, engine.errored

    error, errored = run(body)
    assert isinstance(error, EngineDeadError) and errored


def test_another_event_loop_gets_a_clear_error():
    engine = AsyncLLM.from_engine_args(model=None)
    try:
        first = asyncio.run(collect(engine, "x", SamplingParams(max_tokens=2, ignore_eos=True), "a"))
        assert first[-1].finished
        with pytest.raises(RuntimeError, match="event loop"):
            asyncio.run(asyncio.wait_for(collect(engine, "x", SamplingParams(max_tokens=2), "b"), HANG_S))
        with pytest.raises(RuntimeError, match="event loop"):
            asyncio.run(asyncio.wait_for(engine.reset_prefix_cache(), HANG_S))
        outcome: list = []

        def other_thread():
            try:
                asyncio.run(asyncio.wait_for(collect(engine, "x", SamplingParams(max_tokens=2), "c"), HANG_S))
            except Exception as exc:  # noqa: BLE001 - inspected below
                outcome.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(HANG_S)
        assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError) and "event loop" in str(outcome[0])
        assert not engine.errored and engine._collectors == {}
    finally:
        engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "x", SamplingParams(max_tokens=2), "d"))
