"""Time ``LLM.generate`` in-process on the built-in model, for A/B comparisons of two source trees.

Run it alternately under each tree (e.g. ``PYTHONPATH=/path/to/old/layout`` for the old one) and
compare the medians; alternate the order between rounds, since a shared VM drifts within minutes.

    SPARROW_CPU_THREADS=2 python scripts/ab_generate.py LABEL
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("SPARROW_ENABLE_MULTIPROCESSING", "0")  # one process: no IPC noise

from sparrow import LLM, SamplingParams  # noqa: E402


def main(label: str) -> None:
    llm = LLM(seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    # 32 prompts of 64 tokens, 96 decode steps each: decode-heavy, like the CPU benchmark.
    prompts = [{"prompt_token_ids": [(7 * i + j) % 400 + 10 for j in range(64)]} for i in range(32)]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(4):
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    print(label, " ".join(f"{t:.2f}" for t in times), "median", f"{statistics.median(times):.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
