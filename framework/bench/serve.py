"""``sparrow bench serve``: an online benchmark against a running ``sparrow serve``.

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), bounded by
``--num-prompts`` and ``--max-seconds`` (no request starts after that). Each is a random
token-id prompt (length uniform in [input_len_min, input_len_max)) sent to /v1/completions with
``max_tokens`` uniform in [output_len_min, output_len_max), ``ignore_eos`` and streaming, like
the offline CPU workload. Reported with vLLM's names: completed, failed, request throughput,
output token throughput, TTFT, TPOT, ITL and E2EL (mean, median, p99, in ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str | None = None
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first streamed text
    latency: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks


def make_requests(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        prompt_len = rng.randrange(*input_len)
        # Avoid the top of the vocabulary, where the tiny tokenizer keeps special tokens.
        prompt = [rng.randrange(0, vocab_size - 16) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, rng.randrange(*output_len)))
    return requests


async def send_request(client: Any, url: str, model: str | None, request: BenchRequest,
                       temperature: float) -> RequestResult:
    payload: dict[str, Any] = {
        "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens, "ignore_eos": True,
        "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
    }
    if model:
        payload["model"] = model
    result = RequestResult(prompt_len=len(request.prompt_token_ids))
    started = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    if result.ttft == 0.0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - started
        result.success = result.error is None
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)

    async def one(client: httpx.AsyncClient, request: BenchRequest) -> RequestResult:
        if semaphore is None:
            return await send_request(client, url, args.model, request, args.temperature)
        async with semaphore:
            return await send_request(client, url, args.model, request, args.temperature)

    from tqdm.auto import tqdm

    # Finished requests out of those planned (--max-seconds may stop sending early); on stderr.
    bar = tqdm(total=len(requests), desc="requests", unit="req", dynamic_ncols=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), headers=headers, limits=limits) as client:
        tasks = []
        started = time.perf_counter()
        with bar:
            for request in requests:
                if time.perf_counter() - started > args.max_seconds:
                    bar.total = len(tasks)
                    bar.refresh()
                    break
                task = asyncio.create_task(one(client, request))
                task.add_done_callback(lambda _: bar.update(1))
                tasks.append(task)
                if args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return list(results), duration


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(ordered) * 1000, "median": statistics.median(ordered) * 1000, "p99": p99 * 1000}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    # TPOT: time per output token after the first, per request.
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration if duration else 0.0,
    }
    for name, values in (("ttft", [r.ttft for r in done]), ("tpot", tpot),
                         ("itl", [gap for r in done for gap in r.itl]), ("e2el", [r.latency for r in done])):
        for stat, value in _percentiles(values).items():
            summary[f"{stat}_{name}_ms"] = value
    errors = [r.error for r in results if r.error]
    if errors:
        summary["errors"] = errors[:10]
    return summary


def print_table(summary: dict[str, Any]) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total generated tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {title} --", ""))
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms)",
                         f"{summary[f'{stat}_{name}_ms']:.2f}"))
    for name, value in rows:
        print(f"{name:<44}{value:>16}")
    print("=" * 60)
    for error in summary.get("errors", []):
        print(f"error: {error}")


def run(args: argparse.Namespace) -> int:
    requests = make_requests(args.num_prompts, (args.input_len_min, args.input_len_max),
                             (args.output_len_min, args.output_len_max), args.vocab_size, args.seed)
    results, duration = asyncio.run(run_benchmark(args, requests))
    summary = summarize(results, duration)
    summary.update({
        "benchmark": "serve", "base_url": args.base_url, "request_rate": args.request_rate,
        "num_prompts": args.num_prompts, "max_seconds": args.max_seconds,
        "machine": f"{platform.node()} {platform.machine()}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })
    print(f"machine: {summary['machine']}  {summary['date']}  rate: {args.request_rate} req/s")
    print_table(summary)
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
        print(f"wrote {path}")
    return 0 if summary["failed"] == 0 else 1


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sparrow bench serve`` to the ``bench`` subcommands."""
    parser = subparsers.add_parser("serve", help="online benchmark against a running sparrow serve")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrival rate in requests/s (default: inf, all at once)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="no request starts after this many seconds")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    parser.add_argument("--input-len-min", type=int, default=16, help="shortest prompt, in tokens")
    parser.add_argument("--input-len-max", type=int, default=400, help="prompt lengths are below this")
    parser.add_argument("--output-len-min", type=int, default=16, help="smallest max_tokens of a request")
    parser.add_argument("--output-len-max", type=int, default=200, help="max_tokens values are below this")
    parser.add_argument("--vocab-size", type=int, default=4096, help="prompt token ids are drawn below this")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrival times")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--result-file", default="bench-results/serve.json", help="JSON report path ('' for none)")
    parser.set_defaults(func=run)
    return parser
