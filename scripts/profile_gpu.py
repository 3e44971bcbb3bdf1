"""Where a GPU decode step's time goes, in one command for the next session with a GPU.

Runs the GPU benchmark's workload (Qwen3-0.6B shapes, random bf16 weights; fewer requests by
default) with the engine core in this process and ``torch.profiler`` over a window of steps, then
prints:

* wall time per step over the window;
* device time per kernel family (attention, GEMM, sampling, element-wise, copies) and the device's
  busy fraction over the window: the gap between it and 100 % is the time the GPU waits on the host;
* the host operators that cost the most.

It writes a Chrome trace (``--trace``) to open in Perfetto. ``--device cpu`` with a small
``--num-prompts`` runs the same code path on the CPU (a smoke test of the script itself).

    python scripts/profile_gpu.py [--num-prompts 256] [--steps 200] [--trace gpu_trace.json]
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("SPARROW_ENABLE_MULTIPROCESSING", "0")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="model directory (default: Qwen3-0.6B-shaped random)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--len-min", type=int, default=100)
    parser.add_argument("--len-max", type=int, default=1024)
    parser.add_argument("--skip-steps", type=int, default=20, help="steps before the window (prefill)")
    parser.add_argument("--steps", type=int, default=200, help="steps in the profiled window")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from sparrow import LLM, SamplingParams
    from sparrow.engine.core import EngineCore
    from sparrow.worker.profiler import device_time_by_family

    model = args.model
    engine_args: dict = {"device": args.device, "max_num_seqs": 256}
    if model is None and args.device == "cuda":
        from sparrow.bench.gpu import build_qwen3_0_6b
        from sparrow.tiny.model import cache_root

        model = str(build_qwen3_0_6b(cache_root() / "qwen3-0.6b-random"))
        engine_args["max_num_batched_tokens"] = 16384
    llm = LLM(model, seed=0, **engine_args)
    vocab = min(llm.llm_engine.tokenizer.vocab_size, 4096)
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(args.num_prompts):
        prompt_len = rng.randint(args.len_min, args.len_max)
        prompts.append({"prompt_token_ids": [rng.randrange(vocab - 16) for _ in range(prompt_len)]})
        params.append(SamplingParams(max_tokens=rng.randint(args.len_min, args.len_max), ignore_eos=True,
                                     temperature=0.6, seed=i, detokenize=False))
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up

    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    window = {"step": 0, "started": None, "elapsed": 0.0}
    original_step = EngineCore.step
    prof = profile(activities=activities, record_shapes=False)

    def step(self):
        index = window["step"]
        window["step"] += 1
        if index == args.skip_steps:
            synchronize()
            prof.start()
            window["started"] = time.perf_counter()
        try:
            return original_step(self)
        finally:
            if index == args.skip_steps + args.steps - 1:
                synchronize()
                window["elapsed"] = time.perf_counter() - window["started"]
                prof.stop()

    EngineCore.step = step
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - started
    EngineCore.step = original_step
    llm.shutdown()

    steps = min(args.steps, max(0, window["step"] - args.skip_steps))
    print(f"whole run: {total:.2f} s, {window['step']} steps; window: {steps} steps from step {args.skip_steps}")
    if not steps or window["started"] is None:
        print("the run ended before the window; lower --skip-steps")
        return
    elapsed = window["elapsed"] or (time.perf_counter() - window["started"])
    print(f"window wall time: {elapsed:.3f} s = {elapsed / steps * 1e3:.2f} ms per step")
    device_time = device_time_by_family(prof)
    if device_time:
        busy = sum(device_time.values())
        print(f"device busy: {busy:.3f} s = {busy / elapsed:.0%} of the window "
              f"({(elapsed - busy) / steps * 1e3:.2f} ms per step idle, waiting on the host)")
        for label, seconds in sorted(device_time.items(), key=lambda kv: -kv[1]):
            print(f"  {label:14s} {seconds:7.3f} s  {seconds / steps * 1e3:6.2f} ms/step")
    print("top host operators (self CPU time):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")


if __name__ == "__main__":
    main()
