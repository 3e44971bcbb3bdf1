"""Tensor parallel across worker processes (gloo on CPU): tp=2 must give tp=1's tokens.

Real spawned workers, real ZMQ sockets, real torch.distributed; the tp=1 reference runs in the
test process. Batches mix greedy and seeded random sampling, and a prompt long enough to be
chunked, so the persistent batches of both ranks are exercised the way serving does.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest

from sparrow import LLM, SamplingParams
from sparrow.engine.exceptions import EngineDeadError

ENGINE_ARGS = dict(max_model_len=256, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=64)
PROMPT_LENGTHS = [1, 5, 23, 100]
MAX_TOKENS = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def kv1_model_dir(tmp_path_factory) -> str:
    """Llama with one KV head: with tp=2 each rank holds a replica of it."""
    from tests.conftest import build_test_model

    return build_test_model(tmp_path_factory.mktemp("kv1") / "llama_kv1", arch="llama", preset="test", seed=4,
                            num_key_value_heads=1)


def batch() -> tuple[list[dict], list[SamplingParams]]:
    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 3000 for i in range(n)]} for n in PROMPT_LENGTHS]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    params = [greedy if index % 2 == 0 else
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=index, ignore_eos=True, logprobs=1)
              for index in range(len(prompts))]
    return prompts, params


def generate(llm: LLM):
    prompts, params = batch()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outputs]


@functools.lru_cache(maxsize=None)  # one single-device run per model directory
def reference_outputs(model_dir: str):
    llm = LLM(model_dir, multiprocess=False, **ENGINE_ARGS)
    try:
        return generate(llm)
    finally:
        llm.shutdown()


def check_matches_tp1(llm: LLM, model_dir: str) -> None:
    reference = reference_outputs(model_dir)
    got = generate(llm)
    for index, ((ref_tokens, ref_logprobs), (tokens, logprobs)) in enumerate(zip(reference, got)):
        assert tokens == ref_tokens, f"prompt {index} (len {PROMPT_LENGTHS[index]}) differs with tp=2"
        assert logprobs == pytest.approx(ref_logprobs, abs=ATOL), f"prompt {index} logprobs differ with tp=2"
    # Every rank holds a shard, but the engine reports the whole model's size, as HF counts it.
    from transformers import AutoModelForCausalLM

    assert llm.num_parameters() == AutoModelForCausalLM.from_pretrained(model_dir).num_parameters()


def _agree_worker(rank: int, init_file: str, result_dir: str) -> None:
    import types

    import torch

    from sparrow.layers.parallel import ParallelContext
    from sparrow.worker.model_runner import ModelRunner

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        runner = types.SimpleNamespace(model=types.SimpleNamespace(tp=ParallelContext(rank=rank, world_size=2)))
        # Each rank "drew" different tokens, as unseeded sampling with diverged RNGs would.
        drawn = torch.tensor([100 * rank + 1, 100 * rank + 2], dtype=torch.int64)
        agreed = ModelRunner.agree_on_sampled(runner, drawn)
        Path(result_dir, f"rank{rank}.txt").write_text(repr(agreed.tolist()))
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_keeps_rank0s_sampled_tokens(tmp_path):
    import torch

    torch.multiprocessing.spawn(_agree_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["[1, 2]", "[1, 2]"]


@pytest.mark.parametrize("arch", ["qwen2", "llama_kv1"])
def test_tp2_gives_the_tokens_of_tp1(arch, model_dirs, kv1_model_dir):
    model_dir = kv1_model_dir if arch == "llama_kv1" else model_dirs[arch]
    # The engine core stays in this process; the two ranks are spawned processes.
    llm = LLM(model_dir, multiprocess=False, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        check_matches_tp1(llm, model_dir)
    finally:
        llm.shutdown()


# -- the engine core in its own process (LLM's default): llama and qwen3, then failures ----------
def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(is_running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes {[p for p in pids if is_running(p)]} outlived the engine"
        time.sleep(0.1)


def worker_pids(llm: LLM) -> dict[int, int]:
    return {info["rank"]: info["pid"] for info in llm.llm_engine.collective_rpc("process_info")}


def test_killing_a_worker_fails_in_flight_requests_promptly(model_dirs):
    llm = LLM(model_dirs["llama"], tensor_parallel_size=2, enable_sleep_mode=True, **ENGINE_ARGS)
    engine = llm.llm_engine
    try:
        check_matches_tp1(llm, model_dirs["llama"])
        # Sleep mode reaches every rank: level 2 discards both ranks' shards (the final norm reads
        # zeros after waking), and reload_weights reads each rank's shard of the checkpoint again.
        llm.sleep(level=2)
        assert llm.is_sleeping()
        llm.wake_up()
        assert llm.apply_model(lambda model: float(model.model.norm.weight.abs().sum())) == [0.0, 0.0]
        llm.collective_rpc("reload_weights")
        check_matches_tp1(llm, model_dirs["llama"])
        pids = worker_pids(llm)
        assert sorted(pids) == [0, 1] and all(is_running(pid) for pid in pids.values())
        # A failed utility call is the caller's error only; the engine keeps working.
        with pytest.raises(RuntimeError, match="no method 'no_such_method'"):
            engine.collective_rpc("no_such_method")
        # A function of the worker runs on every rank (sent pickled: a closure works), results in
        # rank order; apply_model hands it each rank's model; a timeout is a TimeoutError.
        offset = 100
        assert llm.collective_rpc(lambda worker, x, y=0: (worker.rank, os.getpid(), x + y + offset), args=(1,),
                                  kwargs={"y": 2}) == [(0, pids[0], 103), (1, pids[1], 103)]
        assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"] * 2
        with pytest.raises(TimeoutError, match=r"collective_rpc\(a function\) got no answer .* within 0.2s"):
            engine.collective_rpc(lambda worker: time.sleep(1.0), timeout=0.2)
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for index in range(4):
            engine.add_request(str(index), {"prompt_token_ids": list(range(10 + index, 30 + index))}, params)
        for _ in range(3):
            engine.step()
        assert engine.has_unfinished_requests()
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1 .*SIGKILL"):
            while time.monotonic() - killed_at < 60:
                engine.step()
        assert time.monotonic() - killed_at < 15, "the dead worker was noticed too late"
        core_pid = engine.engine_core.proc.pid
    finally:
        llm.shutdown()
    wait_gone([pids[0], pids[1], core_pid])


def test_workers_exit_when_the_engine_process_is_killed(model_dirs):
    llm = LLM(model_dirs["qwen3"], tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        check_matches_tp1(llm, model_dirs["qwen3"])
        pids = worker_pids(llm)
        os.kill(llm.llm_engine.engine_core.proc.pid, signal.SIGKILL)
        wait_gone(pids.values())
    finally:
        llm.shutdown()
