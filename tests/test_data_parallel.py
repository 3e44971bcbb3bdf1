"""Data parallel: N engine cores behind one frontend, balanced by unfinished requests."""

from __future__ import annotations

import gc
import time

import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import EngineConfig
from sparrow.engine.dp_client import DPClient
from sparrow.engine.messages import EngineCoreRequest
from tests.test_lifecycle import wait_gone

FAKE = "tests.fake_executor:FakeExecutor"


def make_request(request_id: str, max_tokens: int = 4) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=list(range(1, 9)), sampling_params=params,
                             max_tokens=max_tokens)


def test_dp2_serves_a_concurrent_batch_on_both_engines(qwen3_dir):
    engine_args = dict(max_model_len=256, dtype="float32", num_kv_blocks=64)
    prompts = [{"prompt_token_ids": [(3 * i + n) % 3000 for i in range(n)]} for n in (1, 4, 9, 16, 25, 36, 49, 64)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reference_llm = LLM(qwen3_dir, multiprocess=False, **engine_args)
    reference = [o.outputs[0].token_ids for o in reference_llm.generate(prompts, params, use_tqdm=False)]
    reference_llm.shutdown()

    # Two engine-core processes; the stats line on, at an interval this test never reaches.
    llm = LLM(qwen3_dir, data_parallel_size=2, disable_log_stats=False, log_stats_interval=3600, **engine_args)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        # The one stats line covers both engines' tokens, and says so.
        line = llm.llm_engine.stat_logger.format_lines(time.monotonic())[0]
        assert line.startswith("2 Engines Aggregated: Avg prompt throughput: "), line
        assert llm.llm_engine.stat_logger.num_generation_tokens == 5 * len(prompts)
        assert llm.llm_engine.stat_logger.num_prompt_tokens == sum(len(p["prompt_token_ids"]) for p in prompts)
        client = llm.llm_engine.engine_core
        assert isinstance(client, DPClient)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        assert all(o.finished for o in outputs)
        # All eight arrived before any finished: the fewest-unfinished rule alternates engines.
        assert client.num_requests_routed == [4, 4]
        assert client.num_requests_finished == [4, 4]
        stats = llm.llm_engine.last_stats
        assert stats.num_total_blocks == 128 and stats.num_running_reqs == 0
        assert llm.llm_engine.collective_rpc("ping") == ["pong", "pong"]  # one worker per engine
        pids = [engine.proc.pid for engine in client.clients]
        assert len(pids) == 2
    except BaseException:
        llm.shutdown()
        raise
    # Dropping the LLM stops both engine-core processes. (tests/test_lifecycle.py checks how the
    # other engines end; this dp=2 one costs seconds to start, so its ending is checked here.)
    del llm, client
    gc.collect()
    wait_gone(pids, "the engine cores of a dropped LLM(data_parallel_size=2)")


@pytest.fixture
def fake_dp_client():
    config = EngineConfig.from_kwargs(max_model_len=4096, data_parallel_size=3)
    client = DPClient(config, multiprocess=False, executor_factory=FAKE)
    yield client
    client.shutdown()


def drain(client: DPClient) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(100):
        outputs = client.get_output()
        for output in outputs.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if outputs.scheduler_stats.num_running_reqs + outputs.scheduler_stats.num_waiting_reqs == 0:
            return tokens
    raise AssertionError("the engines did not finish")


def test_requests_go_to_the_engine_with_the_fewest_unfinished(fake_dp_client):
    client = fake_dp_client
    for index in range(3):
        client.add_request(make_request(f"a{index}", max_tokens=50))
    assert client.num_requests_routed == [1, 1, 1]
    client.abort_requests(["a1"])  # engine 1 now has the fewest unfinished requests
    client.add_request(make_request("b0"))  # -> engine 1 (0 unfinished)
    client.add_request(make_request("b1"))  # -> engine 0 (all tie at 1: the lowest index)
    assert client.num_requests_routed == [2, 2, 1]
    tokens = drain(client)
    assert set(tokens) >= {"a0", "a2", "b0", "b1"}
    assert len(tokens["b0"]) == len(tokens["b1"]) == 4
    assert client.num_requests_finished == [2, 1, 1]  # a1 was aborted: it counts as no engine's finish


def test_utilities_reach_every_engine_and_combine(fake_dp_client):
    info = fake_dp_client.call_utility("get_kv_cache_info")
    assert info["num_blocks"] == 64 and info["num_free_blocks"] == 3 * 64
    assert fake_dp_client.call_utility("reset_prefix_cache") is True
    stats = fake_dp_client.call_utility("get_scheduler_stats")
    assert stats.num_total_blocks == 3 * 64


def test_async_client_spreads_concurrent_requests_over_engine_processes():
    import asyncio

    from sparrow.engine.dp_client import AsyncDPClient

    async def run(client: AsyncDPClient) -> dict[str, list[int]]:
        for index in range(4):
            await client.add_request_async(make_request(f"r{index}", max_tokens=5))
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        while len(finished) < 4:
            outputs = await asyncio.wait_for(client.get_output_async(), timeout=30)
            for output in outputs.outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finished:
                    finished.add(output.request_id)
        assert (await client.call_utility_async("get_kv_cache_info"))["num_free_blocks"] == 2 * 64
        return tokens

    client = AsyncDPClient(EngineConfig.from_kwargs(max_model_len=4096, data_parallel_size=2), executor_factory=FAKE)
    try:
        assert client.kv_cache_info["num_blocks"] == 64
        tokens = asyncio.run(run(client))
        assert all(len(ids) == 5 for ids in tokens.values())
        assert client.num_requests_routed == [2, 2] and client.num_requests_finished == [2, 2]
    finally:
        client.shutdown()
    assert client.is_dead


def test_data_parallel_engines_take_consecutive_device_groups():
    from sparrow.config import EngineConfig
    from sparrow.engine.dp_client import per_engine_config
    from sparrow.platforms.interface import Platform
    from sparrow.worker.worker_base import WorkerBase

    class RecordingPlatform(Platform):
        name = "recording"

        def device_for_rank(self, local_rank):
            return f"dev{local_rank}"

    config = EngineConfig.from_kwargs(data_parallel_size=2, tensor_parallel_size=2, max_model_len=64)
    devices = [
        WorkerBase(per_engine_config(config, index), RecordingPlatform(), rank=rank, local_rank=rank,
                   world_size=2).device
        for index in range(2) for rank in range(2)
    ]
    assert devices == ["dev0", "dev1", "dev2", "dev3"]


def test_data_parallel_rank_picks_the_engine(fake_dp_client, qwen3_dir):
    """vLLM's data_parallel_rank (AsyncLLM.generate's argument, the server's X-data-parallel-rank
    header): a KV-aware router's choice of engine beats the fewest-unfinished rule."""
    import asyncio

    from sparrow import AsyncLLM
    from sparrow.errors import InvalidArgumentError

    client = fake_dp_client
    for index in range(3):
        request = make_request(f"r{index}", max_tokens=50)
        request.data_parallel_rank = 2
        client.add_request(request)
    client.add_request(make_request("free"))  # no rank: the fewest unfinished, engine 0
    assert client.num_requests_routed == [1, 0, 3]
    assert set(drain(client)) >= {"r0", "r1", "r2", "free"}

    async def body(engine):
        params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
        outputs = [output async for output in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "x",
                                                               data_parallel_rank=1)]
        with pytest.raises(InvalidArgumentError, match=r"data_parallel_rank of request 'y' must be an integer in "
                                                       r"\[0, 2\)") as caught:
            async for _ in engine.generate("hi", params, "y", data_parallel_rank=2):
                pass
        assert caught.value.field == "data_parallel_rank"
        return outputs, engine.engine_core.num_requests_routed

    async def main():
        engine = AsyncLLM(EngineConfig.from_kwargs(model=qwen3_dir, max_model_len=256, data_parallel_size=2),
                          executor_factory=FAKE)
        try:
            return await asyncio.wait_for(body(engine), 60)
        finally:
            engine.shutdown()

    outputs, routed = asyncio.run(main())
    assert outputs[-1].finished and routed == [0, 1]
