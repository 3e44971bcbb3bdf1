"""``sparrow bench serve``'s flags: the parser, and vLLM's flags (``--host``/``--port``,
``--random-input-len`` ...) resolved onto ours and checked before the run."""

from __future__ import annotations

import argparse
from typing import Any

from sparrow.bench.outputs import RULE as OUTPUT_RULE
from sparrow.bench.workload_flags import check_length_ranges, resolve_lengths

RANDOM_LENGTHS = dict(input_len_min=16, input_len_max=400, output_len_min=16, output_len_max=200)


def resolve_workload_flags(args: argparse.Namespace) -> None:
    """vLLM's flags (--host/--port, --random-input-len, --random-output-len, --random-range-ratio)
    onto ours, and every flag checked; ValueError naming the flag."""
    if args.host is not None or args.port is not None:
        if args.base_url is not None:
            raise ValueError("--base-url names the server already: give it or --host/--port, not both")
        args.base_url = f"http://{args.host or '127.0.0.1'}:{8000 if args.port is None else args.port}"
    elif args.base_url is None:
        args.base_url = "http://127.0.0.1:8000"
    ratio = args.random_range_ratio
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    for kind in ("input", "output"):
        fixed = getattr(args, f"random_{kind}_len")
        if fixed is None and ratio:
            raise ValueError(f"--random-range-ratio applies to --random-input-len/--random-output-len; "
                             f"--{kind}-len-min/-max give the range themselves")
        # vLLM's random dataset: uniform in [len * (1 - ratio), len * (1 + ratio)].
        resolve_lengths(args, kind, fixed, f"--random-{kind}-len", RANDOM_LENGTHS, ratio)
    check_length_ranges(args)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.vocab_size <= 16:
        raise ValueError(f"--vocab-size must be above 16 (ids are drawn below it minus 16), got {args.vocab_size}")


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sparrow bench serve`` to the ``bench`` subcommands."""
    parser = subparsers.add_parser("serve", help="online benchmark against a running sparrow serve")
    parser.add_argument("--base-url", default=None, help="the server's address (default: http://127.0.0.1:8000)")
    parser.add_argument("--host", default=None, help="the server's host, as vLLM's flag (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="the server's port, as vLLM's flag (default: 8000)")
    parser.add_argument("--dataset-name", choices=("random",), default="random",
                        help="vLLM's workload name; 'random' (token-id prompts) is the one built in, --trace "
                             "replays a recorded or synthetic trace")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="replay a JSONL request trace (arrival times, prompts, output lengths; see "
                             "docs/benchmarks.md) instead of the random workload below")
    parser.add_argument("--trace-answers", choices=("drawn", "server"), default="drawn",
                        help="a conversation turn's copy of the previous answer: 'drawn' ids, sent at the "
                             "trace's arrival time, or the 'server''s real answer, sent at the arrival time "
                             "or when that answer ends, whichever is later (default: drawn)")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Poisson arrival rate in requests/s (default: inf, all at once; not with --trace)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests to send (default: 64; with --trace, the whole trace)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="no request starts after this many seconds")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    parser.add_argument("--input-len-min", type=int, default=None, help="shortest prompt, in tokens (default: 16)")
    parser.add_argument("--input-len-max", type=int, default=None, help="prompt lengths are below this (default: 400)")
    parser.add_argument("--output-len-min", type=int, default=None,
                        help="smallest max_tokens of a request (default: 16)")
    parser.add_argument("--output-len-max", type=int, default=None,
                        help="max_tokens values are below this (default: 200)")
    parser.add_argument("--random-input-len", type=int, default=None,
                        help="vLLM's: every prompt this long (within --random-range-ratio), instead of the range")
    parser.add_argument("--random-output-len", type=int, default=None,
                        help="vLLM's: every max_tokens this (within --random-range-ratio), instead of the range")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="vLLM's: lengths uniform in [L * (1 - r), L * (1 + r)] around the --random-*-len values")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="prompt token ids are drawn below this minus 16 (the tokenizer's special tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrival times")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--result-file", default="bench-results/serve.json",
                        help=f"JSON report path, '' for none ({OUTPUT_RULE})")
    from sparrow.bench.serve import run

    parser.set_defaults(func=run)
    return parser
