"""Batch size 1, greedy: output tok/s with and without n-gram speculation.

    python scripts/bench_spec_decode.py [MODEL] [--max-tokens 128] [--k 4] [--lookup-min 2] [--lookup-max 3]

Two workloads of four prompts each, sent one at a time (batch size 1): "repetitive" prompts whose
text repeats (code, counting, a repeated sentence) and "plain" ones. Each is timed three times per
engine; the best run counts. With the built-in random-weight model the continuations themselves
fall into loops, so drafts are accepted on both workloads; a trained model copies from its prompt
instead. Prints tok/s per engine and workload, the speed-up, the acceptance rate and the mean
number of tokens per step.
"""

from __future__ import annotations

import argparse
import time

from sparrow import LLM, SamplingParams

SENTENCE = "the quick brown fox jumps over the lazy dog and the cat sat on the mat. "
REPETITIVE = ["def add(a, b):\n    return a + b\n" * 3, "hello hello hello hello", SENTENCE * 3,
              "1 2 3 1 2 3 1 2 3 1 2 3"]
PLAIN = ["Once upon a time there was", "In a distant galaxy", "The capital of France is",
         "Explain how a compiler works"]


def best_rate(llm: LLM, prompts: list[str], params: SamplingParams, repeats: int = 3) -> float:
    best = 0.0
    for _ in range(repeats):
        tokens, start = 0, time.perf_counter()
        for prompt in prompts:  # batch size 1
            tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="model directory (default: sparrow-tiny)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=3, help="prompt_lookup_max")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rates: dict[tuple[str, str], float] = {}
    for name, extra in (("off", {}), ("ngram", {"speculative_config": spec})):
        llm = LLM(args.model, **extra)
        try:
            best_rate(llm, REPETITIVE[:1], params, repeats=1)  # warm-up
            for workload, prompts in (("repetitive", REPETITIVE), ("plain", PLAIN)):
                before = llm.llm_engine.last_stats
                rates[(name, workload)] = best_rate(llm, prompts, params)
                after = llm.llm_engine.last_stats
                if name == "ngram" and before is not None and after is not None:
                    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
                    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
                    print(f"{workload:10s} acceptance {accepted / max(drafted, 1):.2f}, "
                          f"tokens per step {1 + accepted / max(drafts, 1):.2f}")
        finally:
            llm.shutdown()
    for workload in ("repetitive", "plain"):
        off, on = rates[("off", workload)], rates[("ngram", workload)]
        print(f"{workload:10s} off {off:7.1f} tok/s   ngram {on:7.1f} tok/s   x{on / off:.2f}")


if __name__ == "__main__":
    main()
