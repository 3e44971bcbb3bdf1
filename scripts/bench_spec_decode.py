"""Batch size 1, greedy: output tok/s with and without n-gram speculation, on a model that copies.

    python scripts/train_copy_model.py --out /tmp/sparrow-copy          # once, about 8 minutes
    python scripts/bench_spec_decode.py /tmp/sparrow-copy [--max-tokens 128] [--k 5] [--lookup-min 2] \\
        [--lookup-max 4] [--rounds 5]

N-gram speculation (prompt lookup) pays off when the output repeats its input: rewriting,
editing code, summarising with quotes. It needs a model that copies, which the built-in
random-weight ``sparrow-tiny`` does not (its greedy output has nothing to do with the prompt), so
MODEL should be the directory that scripts/train_copy_model.py writes: a tiny Qwen3 trained to
continue ``TEXT <separator> TEXT...`` by copying. Without MODEL the script runs on sparrow-tiny,
for comparison only.

Three workloads of four prompts each, sent one at a time (batch size 1, greedy, ``ignore_eos``):

* ``copy``: "rewrite this" prompts, a source text (two prose paragraphs from the corpus tail the
  copy model was not trained on, two code snippets) then the separator and the source's first
  words; the model goes on copying, and the proposer finds each next n-gram in the prompt;
* ``plain``: short prompts with nothing to copy, on the same model. A copy model that has nothing
  to copy repeats itself, and drafts predict the loop: this is no test of the slowdown;
* ``plain, sparrow-tiny``: the same prompts on the random-weight built-in model, whose output
  rarely repeats: drafts are rare and mostly rejected, the case where speculation can only cost
  (skip with ``--no-random-model``).

Both engines stay up and run each workload in turn for several rounds; the median of the per-round
ratios (ngram over off) counts. Prints tok/s per engine and workload, the ratio, the acceptance
rate (accepted over drafted tokens), the mean number of tokens per verification step of a request
that carried drafts, the share of outputs both engines agree on, and for ``copy`` how much of the
output is a faithful copy of the source.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

from sparrow import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_copy_model import HELD_OUT, SEPARATOR  # noqa: E402 - the separator the model was trained on

CODE = [
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError(\"window must be positive\")\n"
    "    total = 0.0\n"
    "    result = []\n"
    "    for index, value in enumerate(values):\n"
    "        total += value\n"
    "        if index >= window:\n"
    "            total -= values[index - window]\n"
    "        result.append(total / min(index + 1, window))\n"
    "    return result",
    "class Counter:\n"
    "    def __init__(self, start=0):\n"
    "        self.count = start\n"
    "\n"
    "    def increment(self, step=1):\n"
    "        self.count += step\n"
    "        return self.count\n"
    "\n"
    "    def reset(self):\n"
    "        self.count = 0",
]
PLAIN = ["Once upon a time there was", "In a distant galaxy", "The capital of France is",
         "Explain how a compiler works"]
PREFIX_WORDS = 4  # the source's first words, repeated after the separator to start the copy


def corpus_paragraphs(count: int) -> list[str]:
    """The first ``count`` paragraphs of 300-700 characters from the corpus tail held out of training."""
    from sparrow.tiny.tokenizer import CORPUS_PATH

    text = CORPUS_PATH.read_text()
    tail = text[int(len(text) * (1 - HELD_OUT)):]
    paragraphs = [p.strip() for p in tail.split("\n\n")[1:]]  # [0] may start mid-paragraph
    return [p for p in paragraphs if 300 <= len(p) <= 700][:count]


def copy_prompt(source: str) -> str:
    # The first words with the whitespace between them but none after: the BPE then splits the
    # prefix as it split the source.
    prefix = re.match(rf"\S+(\s+\S+){{0,{PREFIX_WORDS - 1}}}", source)
    return source + SEPARATOR + (prefix.group(0) if prefix else "")


def copied_share(prompt: str, source: str, output: str) -> float:
    """Share of ``output``'s characters before it first departs from copying ``source`` (over and
    over, the separator between copies, as in training)."""
    repeats = 2 + (len(prompt) + len(output)) // len(source)
    expected = ((source + SEPARATOR) * repeats)[len(prompt):]  # the prompt is this text's prefix
    same = 0
    for got, want in zip(output, expected):
        if got != want:
            break
        same += 1
    return same / max(1, len(output))


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[str]]:
    """Output tok/s over the prompts sent one at a time (batch size 1), and the output texts."""
    tokens, texts, start = 0, [], time.perf_counter()
    for prompt in prompts:
        output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        tokens += len(output.token_ids)
        texts.append(output.text)
    return tokens / (time.perf_counter() - start), texts


def spec_counters(llm: LLM) -> tuple[int, int, int]:
    stats = llm.llm_engine.last_stats
    if stats is None:
        return 0, 0, 0
    return stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


def measure(model: str | None, workloads: dict[str, list[str]], spec: dict, params: SamplingParams,
            rounds: int, sources: list[str]) -> None:
    """One engine without and one with speculation on ``model``; prints a line per workload."""
    # Both engines stay up and take turns, so a drift in the machine's speed (this VM's per-step
    # time moves by tens of percent over minutes) lands on both sides alike.
    engines = {"off": LLM(model), "ngram": LLM(model, speculative_config=spec)}
    try:
        for llm in engines.values():
            run(llm, next(iter(workloads.values()))[:1], params)  # warm-up
        for workload, prompts in workloads.items():
            before = spec_counters(engines["ngram"])
            tok_s: dict[str, list[float]] = {"off": [], "ngram": []}
            texts: dict[str, list[str]] = {}
            for _ in range(rounds):
                for name, llm in engines.items():
                    rate, texts[name] = run(llm, prompts, params)
                    tok_s[name].append(rate)
            drafts, drafted, accepted = (a - b for a, b in zip(spec_counters(engines["ngram"]), before))
            ratios = [on / off for off, on in zip(tok_s["off"], tok_s["ngram"])]
            same = sum(a == b for a, b in zip(texts["off"], texts["ngram"]))
            line = (f"{workload:18s} off {statistics.median(tok_s['off']):6.1f} tok/s   "
                    f"ngram {statistics.median(tok_s['ngram']):6.1f} tok/s   "
                    f"median ratio x{statistics.median(ratios):.2f} "
                    f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); "
                    f"acceptance {accepted / max(drafted, 1):.2f}, "
                    f"tokens per verified step {1 + accepted / max(drafts, 1):.2f}, "
                    f"drafted steps {drafts}; same output {same}/{len(prompts)}")
            if workload.startswith("copy"):
                shares = [copied_share(p, s, t) for p, s, t in zip(prompts, sources, texts["off"])]
                line += f"; copied faithfully {100 * statistics.mean(shares):.0f} % of the output"
            print(line, flush=True)
            print(f"  e.g. {texts['off'][0][:100]!r}", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None,
                        help="model directory, the one train_copy_model.py wrote (default: sparrow-tiny, "
                             "random weights: for comparison only)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (off, then ngram, per workload)")
    parser.add_argument("--no-random-model", action="store_true",
                        help="skip the plain workload on sparrow-tiny")
    args = parser.parse_args()
    if args.model is None:
        print("no MODEL: running on sparrow-tiny, whose random weights do not copy; expect no speed-up",
              flush=True)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    sources = corpus_paragraphs(2) + CODE
    print(f"speculative_config {spec}; max_tokens {args.max_tokens}; {args.rounds} rounds", flush=True)
    measure(args.model, {"copy": [copy_prompt(source) for source in sources], "plain": PLAIN},
            spec, params, args.rounds, sources)
    if args.model is not None and not args.no_random_model:
        # A copy model repeats itself when it has nothing to copy, which drafts predict; the
        # random-weight model's output rarely repeats: drafts are rare and mostly wrong there, the
        # case where speculation can only cost.
        measure(None, {"plain, sparrow-tiny": PLAIN}, spec, params, args.rounds, sources)


if __name__ == "__main__":
    main()
