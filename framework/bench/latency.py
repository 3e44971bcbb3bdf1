"""`sparrow bench latency`: how long one batch takes from submission to its last token (vLLM's
``vllm bench latency``, same flags and report).

One batch of ``--batch-size`` random token-id prompts of ``--input-len`` tokens, each generating
``--output-len`` tokens (``ignore_eos``; ``--n`` samples per prompt at temperature 1.0, or a beam
search of width ``--n`` with ``--use-beam-search``), is generated ``--num-iters-warmup`` times
untimed, then ``--num-iters`` times timed end to end. Printed as vLLM prints it: the average
latency and the 10/25/50/75/90/99th percentiles, in seconds; the JSON report
(``--output-json``/``--result-file``) holds ``avg_latency``, ``latencies`` and ``percentiles`` as
vLLM's does, plus the workload, the machine and the date.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from typing import Any

from sparrow.bench.ablate_checks import parse_engine_args
from sparrow.bench.outputs import RULE as OUTPUT_RULE

PERCENTILES = (10, 25, 50, 75, 90, 99)
PROMPT_ID_LIMIT = 10_000  # vLLM draws prompt ids below 10,000 (below the vocabulary size here)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("latency", help="end-to-end latency of one batch, as vllm bench latency",
                              description="End-to-end latency of one batch of random token-id prompts "
                                          "(vLLM's `bench latency`: same flags, same report).")
    p.add_argument("model", nargs="?", default=None, help="local model directory (default: built-in sparrow-tiny)")
    p.add_argument("--input-len", type=int, default=32, help="prompt length, in tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (the beam width with --use-beam-search)")
    p.add_argument("--use-beam-search", action="store_true", help="beam search of width --n instead of sampling")
    p.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first")
    p.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    p.add_argument("--disable-detokenize", action="store_true", help="do not detokenize the outputs")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the engine")
    p.add_argument("--profile", action="store_true",
                   help="one more, untimed iteration under torch.profiler (traces in SPARROW_TORCH_PROFILER_DIR "
                        "when set) and the device's busy fraction")
    p.add_argument("--result-file", "--output-json", dest="result_file", default="",
                   help=f"JSON report path (vLLM's --output-json), '' for none ({OUTPUT_RULE})")
    p.add_argument("--engine-args", default="{}",
                   help='JSON dict of engine arguments, e.g. \'{"max_num_seqs": 64, "dtype": "bfloat16"}\'')
    p.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> dict[str, Any]:
    """Refuse impossible flags before anything loads; returns the parsed --engine-args."""
    for flag, least in (("input_len", 1), ("output_len", 1), ("batch_size", 1), ("n", 1), ("num_iters", 1),
                        ("num_iters_warmup", 0)):
        if getattr(args, flag) < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least {least}, got {getattr(args, flag)}")
    engine_args = parse_engine_args(args.engine_args)
    return engine_args


def percentiles(latencies: list[float]) -> dict[str, float]:
    """numpy's default (linear) percentiles, keyed as vLLM's report keys them ("10", "25", ...)."""
    import numpy as np

    values = np.percentile(np.asarray(latencies), PERCENTILES)
    return {str(p): float(v) for p, v in zip(PERCENTILES, values)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine_args = check_args(args)  # before torch's seconds of importing

    import random

    import torch
    from tqdm import tqdm

    from sparrow import LLM, SamplingParams
    from sparrow.engine.setup import resolve_model_path
    from sparrow.model_loader import get_hf_config
    from sparrow.sampling_params import BeamSearchParams

    model_path = resolve_model_path(args.model)
    hf_config = get_hf_config(model_path, bool(engine_args.get("trust_remote_code", False)),
                              engine_args.get("hf_overrides"))
    llm = LLM(model=model_path, seed=args.seed, **engine_args)
    try:
        rng = random.Random(args.seed)
        limit = min(hf_config.vocab_size, PROMPT_ID_LIMIT)
        prompts = [{"prompt_token_ids": [rng.randrange(limit) for _ in range(args.input_len)]}
                   for _ in range(args.batch_size)]
        if args.use_beam_search:
            beam = BeamSearchParams(beam_width=args.n, max_tokens=args.output_len, ignore_eos=True)

            def generate() -> int:
                outputs = llm.beam_search(prompts, beam)
                return sum(len(seq.tokens) - args.input_len for output in outputs for seq in output.sequences)
        else:
            params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                                    max_tokens=args.output_len, detokenize=not args.disable_detokenize)

            def generate() -> int:
                outputs = llm.generate(prompts, params, use_tqdm=False)
                return sum(len(completion.token_ids) for output in outputs for completion in output.outputs)

        for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
            generate()
        latencies, tokens = [], []
        for _ in tqdm(range(args.num_iters), desc="Profiling iterations"):
            started = time.perf_counter()
            tokens.append(generate())
            latencies.append(time.perf_counter() - started)
        profile = None
        if args.profile:  # after the timed iterations: the profiler's overhead stays out of them
            llm.start_profile()
            generate()
            profile = llm.stop_profile()
    finally:
        llm.shutdown()
    result: dict[str, Any] = {
        "benchmark": "latency", "model": model_path, "engine_args": engine_args,
        "input_len": args.input_len, "output_len": args.output_len, "batch_size": args.batch_size, "n": args.n,
        "use_beam_search": args.use_beam_search, "num_iters_warmup": args.num_iters_warmup,
        "avg_latency": sum(latencies) / len(latencies), "latencies": latencies,
        "percentiles": percentiles(latencies), "output_tokens_per_iter": tokens,
        "machine": f"{platform.node()} {platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if profile is not None:
        result["profile"] = profile
    print(f"Avg latency: {result['avg_latency']} seconds")
    for percentage, value in result["percentiles"].items():
        print(f"{percentage}% percentile latency: {value} seconds")
    if profile:
        busy = profile[0]["device_busy_fraction"]
        print(f"device busy (profiled iteration): {'n/a' if busy is None else f'{100 * busy:.1f} %'}")
    if args.result_file:
        from pathlib import Path

        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.result_file}")
    return result
