"""The engine core's own work per step (scheduler, block allocation, stop checks) at the GPU
benchmark's concurrency, with the model replaced by an executor that answers instantly.

    python scripts/bench_host_overhead.py [--num-prompts 256] [--len-min 100] [--len-max 1024]
"""

from __future__ import annotations

import argparse
import random
import time

from sparrow import SamplingParams
from sparrow.config import EngineConfig
from sparrow.engine.core import EngineCore
from sparrow.engine.messages import EngineCoreRequest
from sparrow.executor import Executor, KVCacheInfo
from sparrow.worker.outputs import ModelRunnerOutput


class InstantExecutor(Executor):
    """Samples token 7 for every request whose prompt is done, in no time."""

    def __init__(self) -> None:
        self.prompt_left: dict[str, int] = {}

    def initialize(self) -> KVCacheInfo:
        return KVCacheInfo(40000, 16)

    def execute_model(self, scheduler_output):
        for new in scheduler_output.scheduled_new_reqs:
            self.prompt_left[new.req_id] = len(new.prompt_token_ids) - new.num_computed_tokens
        req_ids, sampled = [], []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self.prompt_left[req_id] = self.prompt_left.get(req_id, 1) - num_tokens
            req_ids.append(req_id)
            sampled.append([7] if self.prompt_left[req_id] <= 0 else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def collective_rpc(self, method, args=(), kwargs=None):
        return [None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--len-min", type=int, default=100)
    parser.add_argument("--len-max", type=int, default=1024)
    args = parser.parse_args()
    config = EngineConfig.from_kwargs(max_model_len=2 * args.len_max + 16, max_num_seqs=256,
                                      max_num_batched_tokens=16384)
    core = EngineCore(config, executor=InstantExecutor())
    rng = random.Random(0)
    for i in range(args.num_prompts):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(args.len_min, args.len_max))]
        max_tokens = rng.randint(args.len_min, args.len_max)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.6, detokenize=False)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, max_tokens=max_tokens))
    steps, started = 0, time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    elapsed = time.perf_counter() - started
    print(f"{steps} steps in {elapsed:.2f} s: {elapsed / steps * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
