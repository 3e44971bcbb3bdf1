"""Where a CPU step's time goes, on the offline benchmark workload (docs/benchmarks.md).

Runs the engine core in this process, wraps the step loop's parts and the model's layers with
wall-clock counters, and prints seconds per part for each run. Nested parts are included in their
parents (``run_model`` contains the linear layers, ``attention`` ...).

    python scripts/profile_cpu.py [--runs 2] [--num-prompts 64] [--quantization int8] [--kv-cache-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import time

os.environ.setdefault("SPARROW_ENABLE_MULTIPROCESSING", "0")

TOTALS: dict[str, float] = collections.defaultdict(float)
ORDER: list[str] = []  # labels in the order they are printed (parents before their parts)


def timed(owner: object, name: str, label: str) -> None:
    original = getattr(owner, name)
    if label not in ORDER:  # several owners may share a label
        ORDER.append(label)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def instrument() -> None:
    import sparrow_cpu.native as native
    from sparrow.engine.core import EngineCore
    from sparrow.layers.activation import SiluAndMul
    from sparrow.layers.embedding import ParallelLMHead
    from sparrow.layers.layernorm import RMSNorm
    from sparrow.layers.linear import ColumnParallelLinear, RowParallelLinear
    from sparrow.layers.rotary import RotaryEmbedding
    from sparrow.worker.model_runner import ModelRunner
    from sparrow_cpu.attention import TorchPagedAttention

    timed(EngineCore, "step", "step")
    for name in ("update_states", "prepare_inputs", "run_model", "sample"):
        timed(ModelRunner, name, f"  runner.{name}")
    timed(ColumnParallelLinear, "forward", "    linear layers")
    timed(RowParallelLinear, "forward", "    linear layers")
    timed(ParallelLMHead, "compute_logits", "    LM head")
    timed(TorchPagedAttention, "forward", "    attention")
    timed(TorchPagedAttention, "_write_kv", "      KV cache writes")
    timed(TorchPagedAttention, "_prefill", "      prefill attention (SDPA)")
    timed(RMSNorm, "forward", "    RMSNorm")
    timed(RotaryEmbedding, "forward", "    rotary")
    timed(SiluAndMul, "forward", "    SiLU-and-mul")
    ORDER.insert(ORDER.index("      prefill attention (SDPA)"), "      decode attention (C++)")
    get_paged_attention = native.get_paged_attention

    def timed_kernel():
        kernel = get_paged_attention()
        if kernel is None:
            return None

        def run(*args):
            started = time.perf_counter()
            kernel(*args)
            TOTALS["      decode attention (C++)"] += time.perf_counter() - started
        return run

    native.get_paged_attention = timed_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="profiled runs of the whole workload")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    parser.add_argument("--quantization", default=None, help="e.g. int8 (docs/user-guide.md)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or bfloat16 (docs/user-guide.md)")
    args = parser.parse_args()
    instrument()
    from sparrow import LLM, SamplingParams
    from sparrow.bench.throughput import make_workload

    workload_args = argparse.Namespace(num_prompts=args.num_prompts, input_len_min=16, input_len_max=400,
                                       output_len_min=16, output_len_max=200, seed=0)
    workload = make_workload(workload_args, 4096)
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in workload]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for _, m in workload]
    llm = LLM(seed=0, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (kernels, shapes)
    for run in range(args.runs):
        TOTALS.clear()
        llm.reset_prefix_cache()
        started = time.perf_counter()
        # The progress bar goes to stderr; its cost is one update per finished request.
        llm.generate(prompts, params, use_tqdm=True)
        print(f"run {run + 1}: {time.perf_counter() - started:.2f} s in all")
        for label in ORDER:
            print(f"  {label:34s} {TOTALS.get(label, 0.0):6.2f} s")
    llm.shutdown()


if __name__ == "__main__":
    main()
