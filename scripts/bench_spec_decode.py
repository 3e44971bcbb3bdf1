"""Batch size 1, greedy: output tok/s with and without n-gram speculation.

    python scripts/bench_spec_decode.py [MODEL] [--max-tokens 128] [--k 4] [--lookup-min 2] [--lookup-max 3] \\
        [--rounds 5]

Two workloads of four prompts each, sent one at a time (batch size 1): "repetitive" prompts whose
text repeats (code, counting, a repeated sentence) and "plain" ones. Both engines stay up and run
each workload in turn for several rounds; the median of the per-round ratios counts. With the
built-in random-weight model the continuations themselves
fall into loops, so drafts are accepted on both workloads; a trained model copies from its prompt
instead. Prints tok/s per engine and workload, the speed-up, the acceptance rate and the mean
number of tokens per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sparrow import LLM, SamplingParams

SENTENCE = "the quick brown fox jumps over the lazy dog and the cat sat on the mat. "
REPETITIVE = ["def add(a, b):\n    return a + b\n" * 3, "hello hello hello hello", SENTENCE * 3,
              "1 2 3 1 2 3 1 2 3 1 2 3"]
PLAIN = ["Once upon a time there was", "In a distant galaxy", "The capital of France is",
         "Explain how a compiler works"]


def rate(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:  # batch size 1
        tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="model directory (default: sparrow-tiny)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=3, help="prompt_lookup_max")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (off, then ngram, per workload)")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    # Both engines stay up and take turns, so a drift in the machine's speed (this VM's per-step
    # time moves by tens of percent over minutes) lands on both sides alike.
    engines = {"off": LLM(args.model), "ngram": LLM(args.model, speculative_config=spec)}
    try:
        for llm in engines.values():
            rate(llm, REPETITIVE[:1], params)  # warm-up
        for workload, prompts in (("repetitive", REPETITIVE), ("plain", PLAIN)):
            before = engines["ngram"].llm_engine.last_stats
            rounds: dict[str, list[float]] = {"off": [], "ngram": []}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    rounds[name].append(rate(llm, prompts, params))
            after = engines["ngram"].llm_engine.last_stats
            ratios = [on / off for off, on in zip(rounds["off"], rounds["ngram"])]
            line = (f"{workload:10s} off {statistics.median(rounds['off']):6.1f} tok/s   "
                    f"ngram {statistics.median(rounds['ngram']):6.1f} tok/s   "
                    f"median ratio x{statistics.median(ratios):.2f} "
                    f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
            if before is not None and after is not None:
                drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
                drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
                line += (f"; acceptance {accepted / max(drafted, 1):.2f}, "
                         f"tokens per verified step {1 + accepted / max(drafts, 1):.2f}")
            print(line, flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
