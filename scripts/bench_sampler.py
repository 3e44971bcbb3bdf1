"""Time one sampling step (metadata + sampler call) at the GPU benchmark's vocabulary (151,936 tokens).

    python scripts/bench_sampler.py [--rows 64 256] [--vocab 151936] [--device cpu] [--repeats 20]
                                    [--mix greedy temperature ...] [--threads 1] [--json out.json]

One line per (rows, mix): the median and the best of ``--repeats`` steps, in milliseconds. A step is
what the worker does per decode step: every row appends one token to its output list, then
``SamplingTensors.metadata`` and the sampler run. Mixes:

* greedy: temperature 0;
* temperature: temperature 0.6;
* top_k_top_p: temperature 0.6, top-k 50, top-p 0.9 (the usual chat defaults);
* top_p: temperature 0.6, top-p 0.9 (no top-k: the full sort);
* penalties: temperature 0.6 with repetition, frequency and presence penalties, 300 tokens of
  output history per row and 100 prompt tokens;
* seeded: temperature 0.6, every row with its own seed;
* logprobs: temperature 0.6, one row in eight asks for 5 logprobs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sparrow import SamplingParams
from sparrow.sample.metadata import SamplingTensors
from sparrow.sample.sampler import Sampler

MIXES = {
    "greedy": lambda row: SamplingParams(temperature=0.0),
    "temperature": lambda row: SamplingParams(temperature=0.6),
    "top_k_top_p": lambda row: SamplingParams(temperature=0.6, top_k=50, top_p=0.9),
    "top_p": lambda row: SamplingParams(temperature=0.6, top_p=0.9),
    "penalties": lambda row: SamplingParams(temperature=0.6, repetition_penalty=1.1, frequency_penalty=0.2,
                                            presence_penalty=0.1),
    "seeded": lambda row: SamplingParams(temperature=0.6, seed=row),
    "logprobs": lambda row: SamplingParams(temperature=0.6, logprobs=5 if row % 8 == 0 else None),
}
HISTORY = {"penalties": 300}  # output tokens each row already has
PROMPT = {"penalties": 100}


def time_mix(mix: str, rows: int, vocab: int, device: str, repeats: int) -> list[float]:
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(device)
    params = [MIXES[mix](row) for row in range(rows)]
    prompts = [torch.randint(0, vocab, (PROMPT.get(mix, 1),), generator=generator).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (HISTORY.get(mix, 5),), generator=generator).tolist() for _ in range(rows)]
    tensors = SamplingTensors(vocab, device)
    tensors.update_batch(params, prompts)
    sampler = Sampler(torch.Generator(device=device).manual_seed(0))
    times = []
    for step in range(repeats + 2):  # two warm-up steps
        synchronize()
        started = time.perf_counter()
        sampled = sampler(logits, tensors.metadata(outputs)).sampled_token_ids.tolist()
        synchronize()
        if step >= 2:
            times.append(time.perf_counter() - started)
        for row, token in enumerate(sampled):  # what the worker does after the step
            outputs[row].append(token)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--mix", nargs="+", choices=sorted(MIXES), default=list(MIXES))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'rows':>5s} {'mix':12s} {'median ms':>10s} {'best ms':>9s}")
    results = []
    for rows in args.rows:
        for mix in args.mix:
            times = time_mix(mix, rows, args.vocab, args.device, args.repeats)
            median_ms, best_ms = statistics.median(times) * 1e3, min(times) * 1e3
            print(f"{rows:5d} {mix:12s} {median_ms:10.2f} {best_ms:9.2f}", flush=True)
            results.append({"rows": rows, "mix": mix, "median_ms": median_ms, "best_ms": best_ms})
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"vocab": args.vocab, "device": args.device, "threads": args.threads,
                       "repeats": args.repeats, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
