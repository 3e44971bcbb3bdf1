"""The engine core in its own process: real spawn, real ZMQ sockets, the fake model in the child.

The executor (the far side of the engine core) is the deterministic FakeExecutor, built in the
engine process from an import path; everything between the client and the scheduler is real.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from sparrow.config import EngineConfig
from sparrow.core.request import FinishReason
from sparrow.engine.core_client import InprocClient
from sparrow.engine.exceptions import EngineDeadError, EngineStartupError
from sparrow.engine.messages import EngineCoreRequest, SchedulerStats
from sparrow.engine.mp_client import AsyncMPClient, SyncMPClient, make_client
from sparrow.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor, next_token

FAKE = "tests.fake_executor:FakeExecutor"
SLOW = "tests.test_engine_proc:slow_executor"
REPO_ROOT = Path(__file__).resolve().parents[1]


# -- executors built inside the engine process by import path -----------------------------------
class SlowExecutor(FakeExecutor):
    """A step takes 20 ms, so a long request is surely still running when the test acts."""

    def execute_model(self, scheduler_output):
        time.sleep(0.02)
        return super().execute_model(scheduler_output)


class ExplodingExecutor(FakeExecutor):
    def execute_model(self, scheduler_output):
        if len(self.history) == 3:
            raise RuntimeError("the device caught fire")
        return super().execute_model(scheduler_output)


def slow_executor() -> FakeExecutor:
    return SlowExecutor(num_blocks=256)


def exploding_executor() -> FakeExecutor:
    return ExplodingExecutor()


def failing_executor() -> FakeExecutor:
    raise OSError("no such device: /dev/imaginary0")


# -- helpers ------------------------------------------------------------------------------------
def config() -> EngineConfig:
    return EngineConfig.from_kwargs(max_model_len=4096)


def make_request(request_id: str, prompt_len: int = 10, max_tokens: int = 6, start: int = 1) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    prompt = [(start + i) % 1000 for i in range(prompt_len)]
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                             max_tokens=max_tokens)


def expected_tokens(request: EngineCoreRequest) -> list[int]:
    tokens = list(request.prompt_token_ids)
    for _ in range(request.max_tokens):
        tokens.append(next_token(tokens, 1000))
    return tokens[len(request.prompt_token_ids):]


def collect(client: SyncMPClient, request_ids: set[str], timeout_s: float = 30.0) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    unfinished = set(request_ids)
    deadline = time.monotonic() + timeout_s
    while unfinished:
        assert time.monotonic() < deadline, f"requests {unfinished} did not finish"
        for output in client.get_output().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                unfinished.discard(output.request_id)
    return tokens


def child_pids(pid: int) -> set[int]:
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # multiprocessing's resource tracker is a helper shared by the whole session.
            if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in _cmdline(entry):
                children.add(int(entry.name))
    return children


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def sync_client():
    client = SyncMPClient(config(), executor_factory=FAKE)
    yield client
    client.shutdown()


# -- tests --------------------------------------------------------------------------------------
def test_sync_client_runs_requests_to_completion(sync_client):
    requests = [make_request(f"r{i}", prompt_len=5 + 7 * i, max_tokens=3 + i, start=i * 13) for i in range(6)]
    for request in requests:
        sync_client.add_request(request)
    tokens = collect(sync_client, {r.request_id for r in requests})
    for request in requests:
        assert tokens[request.request_id] == expected_tokens(request)
    assert sync_client.kv_cache_info == {"num_blocks": 64, "block_size": 16, "max_model_len": 4096}


def test_utility_calls_return_typed_results_and_fail_by_name(sync_client):
    stats = sync_client.call_utility("get_scheduler_stats")
    assert isinstance(stats, SchedulerStats) and stats.num_total_blocks == 64
    assert sync_client.call_utility("get_kv_cache_info")["num_free_blocks"] == 64
    assert sync_client.call_utility("reset_prefix_cache") is True
    assert sync_client.call_utility("collective_rpc", "initialize") == [{"num_blocks": 64, "block_size": 16}]
    with pytest.raises(RuntimeError, match="no utility method 'fly'"):
        sync_client.call_utility("fly")
    with pytest.raises(RuntimeError, match="no utility method '_schedule'"):
        sync_client.call_utility("_schedule")
    with pytest.raises(RuntimeError, match="no utility method '_schedule_request'"):  # core_pause's helpers
        sync_client.call_utility("_schedule_request", None)


def test_abort_frees_the_blocks_of_a_running_request():
    client = SyncMPClient(config(), executor_factory=SLOW)
    try:
        client.add_request(make_request("long", prompt_len=100, max_tokens=2000))
        while not any(o.new_token_ids for o in client.get_output().outputs):
            pass
        assert client.call_utility("get_kv_cache_info")["num_free_blocks"] < 256
        client.abort_requests(["long"])
        deadline = time.monotonic() + 5
        while client.call_utility("get_kv_cache_info")["num_free_blocks"] != 256:
            assert time.monotonic() < deadline, "aborted request kept its blocks"
            time.sleep(0.02)
    finally:
        client.shutdown()


def test_a_request_the_core_rejects_fails_alone(sync_client):
    too_big = make_request("too-big", prompt_len=2000, max_tokens=10)  # the cache holds 1024 tokens
    fine = make_request("fine")
    sync_client.add_request(too_big)
    sync_client.add_request(fine)
    errors, tokens = {}, {}
    while len(errors) + len(tokens) < 2:
        for output in sync_client.get_output().outputs:
            if output.error_message is not None:
                assert output.finish_reason == FinishReason.ABORT
                errors[output.request_id] = output.error_message
            elif output.finished:
                tokens[output.request_id] = True
    assert "too-big" in errors and "1024 tokens" in errors["too-big"]
    assert "fine" in tokens
    # In-process, the same rejection is the ValueError itself.
    inproc = InprocClient(config(), executor=FakeExecutor())
    with pytest.raises(ValueError, match="1024 tokens"):
        inproc.add_request(make_request("too-big", prompt_len=2000, max_tokens=10))


def test_async_client_runs_concurrent_requests_and_utilities():
    async def main() -> None:
        client = AsyncMPClient(config(), executor_factory=FAKE)
        try:
            requests = [make_request(f"a{i}", prompt_len=3 + i, max_tokens=4, start=i) for i in range(8)]
            for request in requests:
                await client.add_request_async(request)
            stats = await client.call_utility_async("get_scheduler_stats")
            assert isinstance(stats, SchedulerStats)
            tokens: dict[str, list[int]] = {}
            finished: set[str] = set()
            while len(finished) < len(requests):
                outputs = await asyncio.wait_for(client.get_output_async(), 10)
                for output in outputs.outputs:
                    tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                    if output.finished:
                        finished.add(output.request_id)
            for request in requests:
                assert tokens[request.request_id] == expected_tokens(request)
        finally:
            client.shutdown()

    asyncio.run(main())


def test_start_up_failure_is_raised_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(EngineStartupError) as info:
        SyncMPClient(config(), executor_factory="tests.test_engine_proc:failing_executor")
    assert "OSError: no such device: /dev/imaginary0" in str(info.value)
    assert "Traceback" in str(info.value)
    assert time.monotonic() - started < 30
    assert not child_pids(os.getpid())


def test_sigkill_of_the_engine_fails_every_pending_caller_promptly():
    client = SyncMPClient(config(), executor_factory=SLOW)
    try:
        client.add_request(make_request("long", prompt_len=50, max_tokens=3000))
        assert client.get_output() is not None
        failures: dict[str, BaseException] = {}

        def wait_for(name, call):
            try:
                while True:
                    call()
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
                failures[name] = exc

        # A consumer blocked on outputs and one blocked in a utility call to a core that never
        # answers (it is killed first).
        waiters = [threading.Thread(target=wait_for, args=("output", client.get_output))]
        for thread in waiters:
            thread.start()
        os.kill(client.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in waiters:
            thread.join(10)
        assert isinstance(failures["output"], EngineDeadError)
        assert time.monotonic() - killed_at < 5
        assert "exit code -9" in str(failures["output"])
        with pytest.raises(EngineDeadError):
            client.call_utility("get_scheduler_stats")
        with pytest.raises(EngineDeadError):
            client.add_request(make_request("late"))
    finally:
        client.shutdown()


def test_sigkill_fails_a_pending_async_utility_call_and_output_wait():
    async def main() -> None:
        client = AsyncMPClient(config(), executor_factory=SLOW)
        try:
            await client.add_request_async(make_request("long", prompt_len=50, max_tokens=3000))
            await client.get_output_async()
            waiter = asyncio.ensure_future(_drain(client))
            await asyncio.sleep(0.05)
            os.kill(client.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(waiter, 5)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(client.call_utility_async("get_kv_cache_info"), 5)
        finally:
            client.shutdown()

    async def _drain(client: AsyncMPClient) -> None:
        while True:
            await client.get_output_async()

    asyncio.run(main())


def test_an_exception_in_the_busy_loop_is_reported_before_the_engine_dies():
    client = SyncMPClient(config(), executor_factory="tests.test_engine_proc:exploding_executor")
    try:
        client.add_request(make_request("doomed", max_tokens=50))
        with pytest.raises(EngineDeadError, match="the device caught fire"):
            collect(client, {"doomed"}, timeout_s=10)
        client.proc.join(10)
        assert client.proc.exitcode == 1
    finally:
        client.shutdown()


def test_sigterm_stops_the_engine_cleanly():
    client = SyncMPClient(config(), executor_factory=FAKE)
    try:
        client.proc.terminate()
        client.proc.join(10)
        assert client.proc.exitcode == 0
        with pytest.raises(EngineDeadError):
            client.get_output()
    finally:
        client.shutdown()


def test_shutdown_leaves_no_process_and_no_socket_dir():
    client = SyncMPClient(config(), executor_factory=SLOW)
    client.add_request(make_request("busy", max_tokens=3000))
    client.get_output()
    pid, tmpdir = client.proc.pid, client._tmpdir
    client.shutdown()
    assert client.proc.exitcode == 0  # SIGTERM was handled, not escalated to SIGKILL
    assert not is_running(pid)
    assert not os.path.exists(tmpdir)
    assert pid not in child_pids(os.getpid())
    with pytest.raises(EngineDeadError):
        client.add_request(make_request("after"))
    client.shutdown()  # idempotent


def test_engine_exits_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from sparrow.config import EngineConfig
        from sparrow.engine.mp_client import SyncMPClient
        if __name__ == "__main__":
            client = SyncMPClient(EngineConfig.from_kwargs(max_model_len=4096), executor_factory={FAKE!r})
            print(client.proc.pid, flush=True)
            time.sleep(600)
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
        assert is_running(engine_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while is_running(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its parent"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


def test_make_client_honours_the_multiprocessing_switch(monkeypatch):
    monkeypatch.setenv("SPARROW_ENABLE_MULTIPROCESSING", "0")
    client = make_client(config(), executor_factory=FAKE)
    try:
        assert isinstance(client, InprocClient)
    finally:
        client.shutdown()
    monkeypatch.setenv("SPARROW_ENABLE_MULTIPROCESSING", "1")
    client = make_client(config(), executor_factory=FAKE)
    try:
        assert isinstance(client, SyncMPClient)
    finally:
        client.shutdown()


# -- AsyncLLM over the engine process (real tokenizer, fake model) ---------------------------------
@pytest.fixture(scope="module")
def tokenizer_model_dir(tmp_path_factory) -> str:
    from sparrow.tiny.model import build_model_dir

    return str(build_model_dir(tmp_path_factory.mktemp("async-llm-model"), "qwen3", "test", seed=1))


def run_async_llm(model_dir: str, body, executor_factory: str = FAKE, **engine_args):
    from sparrow.engine.async_llm import AsyncLLM

    async def main():
        engine = AsyncLLM.from_engine_args(model=model_dir, executor_factory=executor_factory, **engine_args)
        try:
            return await body(engine)
        finally:
            engine.shutdown()

    return asyncio.run(main())


def test_async_llm_output_kinds_agree_and_many_requests_run_concurrently(tokenizer_model_dir):
    from sparrow.sampling_params import RequestOutputKind

    def params(kind):
        return SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, output_kind=kind)

    async def body(engine):
        async def collect(request_id, kind):
            return [out async for out in engine.generate("a sparrow sings", params(kind), request_id)]

        kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY] * 12
        results = await asyncio.gather(*(collect(f"r{i}", kind) for i, kind in enumerate(kinds)))
        return list(zip(kinds, results)), engine.metrics

    results, metrics = run_async_llm(tokenizer_model_dir, body)
    expected = None
    for kind, outputs in results:
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        if kind == RequestOutputKind.DELTA:
            token_ids = [t for o in outputs for t in o.outputs[0].token_ids]
        else:
            token_ids = outputs[-1].outputs[0].token_ids
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
        expected = expected or token_ids
        assert token_ids == expected and len(token_ids) == 12
    assert metrics.generation_tokens._value.get() == 36 * 12


def test_async_llm_cancelled_consumer_aborts_and_frees_blocks(tokenizer_model_dir):
    async def body(engine):
        async def consume():
            async for _ in engine.generate("x", SamplingParams(max_tokens=900, ignore_eos=True), "long"):
                pass

        task = asyncio.create_task(consume())
        while (await engine.get_kv_cache_info())["num_free_blocks"] == 256:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if (await engine.get_kv_cache_info())["num_free_blocks"] == 256:
                break
            await asyncio.sleep(0.01)
        return await engine.get_kv_cache_info()

    assert run_async_llm(tokenizer_model_dir, body, executor_factory=SLOW)["num_free_blocks"] == 256


def test_async_llm_raises_a_core_rejection_to_its_caller_only(tokenizer_model_dir):
    async def body(engine):
        engine.kv_cache_capacity_tokens = 2**62  # let the core be the one to refuse
        params = SamplingParams(max_tokens=1500, ignore_eos=True)
        with pytest.raises(ValueError, match="1024 tokens"):
            async for _ in engine.generate("too long for the cache", params, "huge"):
                pass
        fine = [o async for o in engine.generate("ok", SamplingParams(max_tokens=3, ignore_eos=True), "fine")]
        return fine[-1]

    final = run_async_llm(tokenizer_model_dir, body)
    assert final.finished and len(final.outputs[0].token_ids) == 3


def test_async_llm_fails_fast_when_the_engine_dies(tokenizer_model_dir):
    async def body(engine):
        stream = engine.generate("x", SamplingParams(max_tokens=900, ignore_eos=True), "doomed")
        await stream.__anext__()
        os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert time.monotonic() - started < 5
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("y", SamplingParams(max_tokens=2), "late"):
                pass
        return True

    assert run_async_llm(tokenizer_model_dir, body, executor_factory=SLOW)
