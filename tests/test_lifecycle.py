"""An engine lives as long as the object that owns it: dropping an ``LLM`` (or a client) shuts its
engine processes down and frees their memory; ``shutdown()`` and ``with`` keep working.

Real ``LLM``s with the built-in model (small KV caches), real processes; the pids are checked in
/proc, so a process that is gone but not reaped (a zombie still holding its pid) counts as alive
only until its parent reaps it, which our shutdown does before it returns.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
import types
import weakref

import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import EngineConfig
from sparrow.engine.exceptions import EngineDeadError
from sparrow.engine.mp_client import AsyncMPClient
from tests.test_engine_proc import FAKE, make_request

SMALL = dict(max_model_len=256, kv_cache_memory_bytes=8 << 20)
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def exists(pid: int) -> bool:
    """Whether ``pid`` still names a process (a zombie too: it is gone once it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(exists(pid) for pid in pids):
        assert time.monotonic() < deadline, f"{what}: pids {[p for p in pids if exists(p)]} are still there"
        time.sleep(0.05)


def engine_pids(llm: LLM) -> list[int]:
    """The engine-core pids of ``llm`` and, with tensor parallelism, its ranks' pids."""
    client = llm.llm_engine.engine_core
    pids = [c.proc.pid for c in client.clients] if hasattr(client, "clients") else [client.proc.pid]
    if llm.llm_engine.config.parallel.tensor_parallel_size > 1:
        pids += [info["pid"] for info in llm.collective_rpc("process_info")]
    return pids


def generate_text(llm: LLM) -> str:
    return llm.generate("Hello", PARAMS, use_tqdm=False)[0].outputs[0].text


@pytest.fixture
def notebook_main(monkeypatch):
    """A ``__main__`` like a Jupyter kernel's: a file that does not exist, a spec that is no module.
    multiprocessing's spawn would try to import it again in every child."""
    main = types.ModuleType("__main__")
    main.__file__ = "/nonexistent/ipykernel_launcher.py"
    main.__spec__ = types.SimpleNamespace(name="ipykernel_launcher_not_importable")
    monkeypatch.setitem(sys.modules, "__main__", main)


def test_a_dropped_llm_shuts_its_engine_down(notebook_main):
    llm = LLM(**SMALL)
    assert generate_text(llm)
    pids = engine_pids(llm)
    collected = weakref.ref(llm)
    del llm
    gc.collect()
    assert collected() is None, "something still refers to the dropped LLM"
    wait_gone(pids, "the engine of a dropped LLM")

    # The next one starts and works; `with` stops it (each start costs CI seconds: one LLM for both).
    with LLM(**SMALL) as again:
        pids = engine_pids(again)
        assert generate_text(again)
    wait_gone(pids, "the engine after `with`")
    with pytest.raises(EngineDeadError):
        generate_text(again)


def test_two_llms_in_turn_never_hold_both():
    llm = LLM(**SMALL)
    first = engine_pids(llm)
    llm = LLM(**SMALL)  # the first is dropped once the second is built
    try:
        wait_gone(first, "the first LLM's engine after the name was rebound")
        second = engine_pids(llm)
        assert all(exists(pid) for pid in second)
        assert generate_text(llm)
    finally:
        llm.shutdown()
    # shutdown() stops the engine (and `with`, in test_a_dropped_llm_shuts_its_engine_down).
    wait_gone(second, "the engine after shutdown()")
    with pytest.raises(EngineDeadError):
        generate_text(llm)
    llm.shutdown()  # idempotent


# data_parallel_size=2: tests/test_data_parallel.py drops its engines after checking their routing.
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2)], ids=["tp2"])
def test_a_dropped_parallel_llm_stops_every_process(parallel):
    llm = LLM(**SMALL, **parallel)
    assert generate_text(llm)
    pids = engine_pids(llm)
    assert len(pids) == 3 if "tensor_parallel_size" in parallel else len(pids) == 2
    del llm
    gc.collect()
    wait_gone(pids, f"the processes of a dropped LLM({parallel})")


def test_a_dropped_async_client_shuts_its_engine_down():
    async def one_request(client: AsyncMPClient) -> None:
        request = make_request("r", max_tokens=3)
        await client.add_request_async(request)
        while not any(o.finished for o in (await client.get_output_async()).outputs):
            pass

    client = AsyncMPClient(EngineConfig.from_kwargs(max_model_len=4096), executor_factory=FAKE)
    asyncio.run(one_request(client))
    pid = client.proc.pid
    del client
    gc.collect()
    wait_gone([pid], "the engine of a dropped AsyncMPClient")
