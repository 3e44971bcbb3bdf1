"""Embedding throughput: ``LLM(runner="pooling").embed`` against HF transformers' ``AutoModel``
on the same prompts, in the same process.

    python scripts/bench_embed.py [--model DIR] [--num-prompts 256] [--min-len 16] [--max-len 400]
                                  [--hf-batch 32] [--repeats 3] [--seed 0] [--json out.json]

The prompts are random token ids with lengths uniform in [min_len, max_len) (the CPU workload's
prompt lengths). HF runs them in batches of ``--hf-batch`` sorted by length (right padding, an
attention mask, the last real token's final hidden state, L2-normalized: what Sparrow's default
LAST pooler computes), which is the fastest way to call it; Sparrow gets the prompts in their
given order. Both vectors are compared (max abs difference) so that the figure is for the same
work. Prints one line per engine with the median over ``--repeats`` runs and the prompt tokens per
second; ``--model`` defaults to the built-in model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def hf_embed(model_dir: str, prompts: list[list[int]], batch_size: int) -> tuple[float, torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
    vectors = torch.empty(len(prompts), model.config.hidden_size)
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            longest = max(len(prompts[row]) for row in rows)
            ids = torch.zeros(len(rows), longest, dtype=torch.long)
            mask = torch.zeros(len(rows), longest, dtype=torch.long)
            for position, row in enumerate(rows):
                ids[position, :len(prompts[row])] = torch.tensor(prompts[row])
                mask[position, :len(prompts[row])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(rows)), mask.sum(1) - 1]
            vectors[rows] = torch.nn.functional.normalize(last, dim=1)
    return time.perf_counter() - started, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=400)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from sparrow import LLM
    from sparrow.engine.setup import resolve_model_path

    model_dir = resolve_model_path(args.model)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 4000) for _ in range(rng.randrange(args.min_len, args.max_len))]
               for _ in range(args.num_prompts)]
    num_tokens = sum(map(len, prompts))
    llm = LLM(model_dir, runner="pooling", max_model_len=max(args.max_len, 512))
    llm.embed([{"prompt_token_ids": p} for p in prompts[:8]], use_tqdm=False)  # warm-up
    sparrow_times, hf_times = [], []
    sparrow_vectors = hf_vectors = None
    for _ in range(args.repeats):  # interleaved, so that both see the machine in the same state
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        sparrow_times.append(time.perf_counter() - started)
        sparrow_vectors = torch.tensor([o.outputs.embedding for o in outputs])
        elapsed, hf_vectors = hf_embed(model_dir, prompts, args.hf_batch)
        hf_times.append(elapsed)
    llm.shutdown()
    difference = float((sparrow_vectors - hf_vectors).abs().max())
    result = {"model": model_dir, "num_prompts": args.num_prompts, "prompt_tokens": num_tokens,
              "sparrow_s": sparrow_times, "hf_s": hf_times, "max_abs_difference": difference,
              "torch_threads": torch.get_num_threads()}
    for name, times in (("sparrow", sparrow_times), ("hf", hf_times)):
        median = statistics.median(times)
        result[f"{name}_tokens_per_s"] = num_tokens / median
        print(f"{name:8s} median {median:6.2f} s over {args.repeats} runs ({', '.join(f'{t:.2f}' for t in times)}): "
              f"{num_tokens / median:,.0f} prompt tok/s")
    print(f"speed-up {statistics.median(hf_times) / statistics.median(sparrow_times):.2f}x; {args.num_prompts} "
          f"prompts, {num_tokens} tokens; max |sparrow - hf| = {difference:.2e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
