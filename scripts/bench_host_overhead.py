"""The engine core's own work (adding requests, scheduling, block allocation and prefix-cache
bookkeeping, stop checks) with the model replaced by an executor that answers instantly.

    python scripts/bench_host_overhead.py                   # the GPU benchmark's 256 requests
    python scripts/bench_host_overhead.py --workload cpu    # the CPU benchmark's 64 requests
    python scripts/bench_host_overhead.py --workload cpu --prefix-caching off
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
    parser.add_argument("--workload", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: 256 requests, prompts and outputs 100-1024, 16384-token steps; "
                             "cpu: 64 requests, prompts 16-399, outputs 16-199, 2048-token steps")
    parser.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    args = parser.parse_args()
    if args.workload == "gpu":
        num_prompts, prompt_lens, output_lens, budget = 256, (100, 1024), (100, 1024), 16384
    else:
        num_prompts, prompt_lens, output_lens, budget = 64, (16, 399), (16, 199), 2048
    config = EngineConfig.from_kwargs(max_model_len=prompt_lens[1] + output_lens[1] + 16, max_num_seqs=256,
                                      max_num_batched_tokens=budget,
                                      enable_prefix_caching=args.prefix_caching == "on")
    core = EngineCore(config, executor=InstantExecutor())
    rng = random.Random(0)
    started = time.perf_counter()
    for i in range(num_prompts):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(*prompt_lens))]
        max_tokens = rng.randint(*output_lens)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.6, detokenize=False)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, max_tokens=max_tokens))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    elapsed = time.perf_counter() - started
    print(f"{num_prompts} requests, {steps} steps in {elapsed:.3f} s: {elapsed / steps * 1e3:.2f} ms per step "
          f"(prefix caching {args.prefix_caching})")


if __name__ == "__main__":
    main()
