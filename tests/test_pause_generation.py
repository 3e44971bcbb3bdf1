"""vLLM's ``AsyncLLM.pause_generation`` / ``resume_generation`` / ``is_paused`` (an RLHF trainer
pauses the engine around a weight update), in a real engine-core process with a real model.

abort ends the streams in flight; wait returns once they have finished; keep freezes them and they
go on after resume (with clear_cache, from recomputed KV). Requests added while paused wait for
resume. Every completed request's tokens equal HF transformers' greedy tokens on the same
directory: a pause changes when tokens come, never which. The server's /pause, /resume and
/is_paused are checked in test_server_flags.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from sparrow import AsyncLLM, RequestOutputKind, SamplingParams
from sparrow.errors import InvalidArgumentError

HANG_S = 60  # "does not hang" bound, never a performance assertion
NUM_TOKENS = 48


@pytest.fixture(scope="module")
def prompts(qwen3_dir):
    rng = random.Random(11)
    return [[rng.randrange(10, 4000) for _ in range(length)] for length in (7, 19, 30, 12)]


@pytest.fixture(scope="module")
def hf_tokens(qwen3_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def greedy(max_tokens: int = NUM_TOKENS) -> SamplingParams:
    # min_tokens, as HF's min_new_tokens, bans EOS until max_tokens (with ignore_eos EOS would be
    # sampled and not stop, which HF never does).
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens,
                          output_kind=RequestOutputKind.CUMULATIVE)


class Stream:
    """A request's stream consumed in the background: its outputs so far."""

    def __init__(self, engine: AsyncLLM, prompt: list[int], request_id: str, max_tokens: int = NUM_TOKENS) -> None:
        self.outputs: list = []
        self.task = asyncio.create_task(self._consume(engine, prompt, request_id, max_tokens))

    async def _consume(self, engine, prompt, request_id, max_tokens):
        async for output in engine.generate({"prompt_token_ids": prompt}, greedy(max_tokens), request_id):
            self.outputs.append(output)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[-1].outputs[0].token_ids if self.outputs else []

    async def reach(self, num_tokens: int) -> None:
        while len(self.token_ids) < num_tokens:
            assert not self.task.done(), "the stream ended early"
            await asyncio.sleep(0.002)

    async def done(self):
        await asyncio.wait_for(self.task, HANG_S)
        return self.outputs[-1].outputs[0]


def run(qwen3_dir, body, **engine_args):
    async def main():
        engine = AsyncLLM.from_engine_args(model=qwen3_dir, dtype="float32", max_model_len=256,
                                           max_num_batched_tokens=64, **engine_args)
        try:
            return await asyncio.wait_for(body(engine), HANG_S * 3)
        finally:
            engine.shutdown()

    return asyncio.run(main())


async def still(stream: Stream, seconds: float = 0.3) -> None:
    """The frozen or held stream makes no progress while paused. (pause_generation returns once
    the frontend has processed every output made before the pause; the stream's consumer task
    takes them from its queue at its next turn of the event loop.)"""
    for _ in range(5):
        await asyncio.sleep(0)
    before = len(stream.token_ids)
    await asyncio.sleep(seconds)
    assert len(stream.token_ids) == before and not stream.task.done()


def test_abort_and_wait(qwen3_dir, prompts, hf_tokens):
    async def body(engine):
        # abort: the streams in flight end with "abort"; a request added while paused waits.
        long = [Stream(engine, prompts[0], "a0", 200), Stream(engine, prompts[1], "a1", 200)]
        await long[0].reach(3)
        await engine.pause_generation(mode="abort")
        assert await engine.is_paused()
        for stream in long:
            assert (await stream.done()).finish_reason == "abort"
        held = Stream(engine, prompts[2], "held")
        await still(held)
        await engine.resume_generation()
        assert not await engine.is_paused()
        assert (await held.done()).token_ids == hf_tokens[2]
        # wait: returns once the requests in flight have finished, whole; a newcomer waits.
        running = Stream(engine, prompts[3], "w0")
        await running.reach(2)
        await engine.pause_generation(mode="wait")
        assert running.task.done() and running.token_ids == hf_tokens[3]
        newcomer = Stream(engine, prompts[0], "w1")
        await still(newcomer)
        await engine.resume_generation()
        assert (await newcomer.done()).token_ids == hf_tokens[0]
        with pytest.raises(InvalidArgumentError, match="mode must be one of abort, wait, keep"):
            await engine.pause_generation(mode="drain")

    run(qwen3_dir, body)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_keep_freezes_requests_until_resume(qwen3_dir, prompts, hf_tokens, async_scheduling):
    async def body(engine):
        results = []
        for clear_cache in (False, True):
            streams = [Stream(engine, prompt, f"k{clear_cache}{i}") for i, prompt in enumerate(prompts)]
            await streams[0].reach(5)
            await engine.pause_generation(mode="keep", clear_cache=clear_cache)
            await still(streams[0])
            preempted_before = (await engine.get_scheduler_stats()).num_preemptions
            await engine.resume_generation()
            results.append(([(await stream.done()).token_ids for stream in streams], preempted_before))
        return results, (await engine.get_scheduler_stats()).num_preemptions

    results, _ = run(qwen3_dir, body, async_scheduling=async_scheduling)
    for tokens, _ in results:
        assert tokens == hf_tokens
    # clear_cache: the frozen requests were preempted, to recompute their KV after resume.
    assert results[1][1] > results[0][1]
