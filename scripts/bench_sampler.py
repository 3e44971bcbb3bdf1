"""Time one sampler call at the GPU benchmark's shape (256 rows x 151,936 tokens, temperature 0.6).

    python scripts/bench_sampler.py [--rows 256] [--vocab 151936] [--device cpu]

Prints the best of 5 calls for unseeded rows and for rows that each carry their own seed.
"""

from __future__ import annotations

import argparse
import time

import torch

from sparrow import SamplingParams
from sparrow.sample.metadata import SamplingTensors
from sparrow.sample.sampler import Sampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    synchronize = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)).to(args.device)
    for seeded in (False, True):
        params = [SamplingParams(temperature=0.6, seed=row if seeded else None) for row in range(args.rows)]
        tensors = SamplingTensors(args.vocab, args.device)
        tensors.update_batch(params, [[1]] * args.rows)
        sampler = Sampler(torch.Generator(device=args.device).manual_seed(0))
        outputs = [[0] * 5 for _ in range(args.rows)]
        sampler(logits, tensors.metadata(outputs))
        best = float("inf")
        for _ in range(5):
            synchronize()
            started = time.perf_counter()
            sampler(logits, tensors.metadata(outputs))
            synchronize()
            best = min(best, time.perf_counter() - started)
        print(f"{'seeded' if seeded else 'unseeded':9s} {best * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
