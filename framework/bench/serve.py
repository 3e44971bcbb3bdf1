"""``sparrow bench serve``: an online benchmark against a running ``sparrow serve``.

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), bounded by
``--num-prompts`` and ``--max-seconds`` (no request starts after that). Each is a random
token-id prompt (length uniform in [input_len_min, input_len_max)) sent to /v1/completions with
``max_tokens`` uniform in [output_len_min, output_len_max), ``ignore_eos`` and streaming, like
the offline CPU workload. Reported with vLLM's names: completed, failed, request throughput,
output token throughput, TTFT, TPOT, ITL and E2EL (mean, median, p99, in ms).

``--trace FILE`` replays a request trace (sparrow.bench.trace) instead: each request is sent at its
``arrival_s`` with its prompt (token ids, or ``prompt_len`` ids drawn so that a ``prefix_group`` shares
its prefix), ``output_len`` as ``max_tokens`` and its ``priority``; ``--trace-answers server`` puts
the server's real answer to a conversation's previous turn into the next turn's prompt (which then
waits for that answer). When the server exposes /metrics,
the prefix-cache hit rate and the preemptions over the run are reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    arrival_s: float | None = None  # from a trace; None: Poisson arrivals at --request-rate
    # --trace-answers server: this request's prefix runs into the answer of request ``extends``
    # (an earlier turn of its conversation), so it waits for that answer and splices it in.
    extends: int | None = None
    prefix_len: int = 0
    return_ids: bool = False  # a later request extends this one: ask for its output token ids


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str | None = None
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first streamed text
    latency: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    prompt_ids: list[int] = field(default_factory=list)  # as sent
    output_ids: list[int] = field(default_factory=list)  # only when the request asked for them


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


def trace_requests(path: str, num_prompts: int | None, vocab_size: int, seed: int,
                   server_answers: bool = False) -> list[BenchRequest]:
    """The first ``num_prompts`` requests of a trace file (all when None), with their prompt ids.
    With ``server_answers``, a request whose ``prefix_len`` goes past its group's latest earlier
    prompt (a conversation's next turn) is chained to that request, to splice in its real answer."""
    from sparrow.bench.trace import load_trace, prompt_tokens

    trace = load_trace(path)
    if num_prompts is not None:
        trace = trace[:num_prompts]
    requests = [BenchRequest(ids, request.output_len, request.priority, request.arrival_s,
                             prefix_len=request.prefix_len)
                for request, ids in zip(trace, prompt_tokens(trace, vocab_size, seed))]
    if server_answers:
        latest: dict[str, int] = {}
        for index, request in enumerate(trace):
            if request.prefix_group is None:
                continue
            before = latest.get(request.prefix_group)
            if before is not None and request.prefix_len > trace[before].num_prompt_tokens:
                requests[index].extends = before
                requests[before].return_ids = True
            latest[request.prefix_group] = index
    return requests


def splice_answer(request: BenchRequest, previous: RequestResult) -> BenchRequest:
    """``request`` with its prefix taken from the previous turn's prompt and real answer (where the
    answer is missing, failed or short, the drawn ids stay; the prompt keeps its length)."""
    head = (previous.prompt_ids + previous.output_ids)[:request.prefix_len]
    return replace(request, prompt_token_ids=head + request.prompt_token_ids[len(head):])


# Counters read from /metrics before and after a run (any "prefix:" namespace, vLLM's or ours).
SERVER_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


async def server_counters(client: Any, base_url: str) -> dict[str, float] | None:
    """The server's cumulative counters, summed over labels; None when it has no /metrics."""
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics")
    except Exception:  # noqa: BLE001 - a server without metrics is still benchmarked
        return None
    if response.status_code != 200:
        return None
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0].rsplit(":", 1)[-1].removesuffix("_total")
        if base in SERVER_COUNTERS:
            try:
                values[base] = values.get(base, 0.0) + float(value)
            except ValueError:
                continue
    return values if "prefix_cache_queries" in values else None


async def send_request(client: Any, url: str, model: str | None, request: BenchRequest,
                       temperature: float) -> RequestResult:
    payload: dict[str, Any] = {
        "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens, "ignore_eos": True,
        "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
    }
    if model:
        payload["model"] = model
    if request.priority:
        payload["priority"] = request.priority
    if request.return_ids:
        payload.update(logprobs=0, return_tokens_as_token_ids=True)
    result = RequestResult(prompt_len=len(request.prompt_token_ids), prompt_ids=request.prompt_token_ids)
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
                if request.return_ids:
                    for choice in chunk.get("choices", []):
                        result.output_ids.extend(_token_ids(choice.get("logprobs")))
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


def _token_ids(logprobs: dict[str, Any] | None) -> list[int]:
    """Ids from a streamed chunk's ``logprobs.tokens`` labelled 'token_id:N' (others are skipped)."""
    ids = []
    for label in (logprobs or {}).get("tokens") or []:
        prefix, _, number = str(label).partition("token_id:")
        if not prefix and number.isdigit():
            ids.append(int(number))
    return ids


async def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest]
                        ) -> tuple[list[RequestResult], float, dict[str, float] | None]:
    """The results, the duration and the server's counters over the run (None without /metrics)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)

    tasks: list[asyncio.Task] = []

    async def one(client: httpx.AsyncClient, request: BenchRequest) -> RequestResult:
        if request.extends is not None:  # the previous turn's answer first (not holding a slot)
            request = splice_answer(request, await tasks[request.extends])
        if semaphore is None:
            return await send_request(client, url, args.model, request, args.temperature)
        async with semaphore:
            return await send_request(client, url, args.model, request, args.temperature)

    from tqdm.auto import tqdm

    # Finished requests out of those planned (--max-seconds may stop sending early); on stderr.
    bar = tqdm(total=len(requests), desc="requests", unit="req", dynamic_ncols=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), headers=headers, limits=limits) as client:
        before = await server_counters(client, args.base_url)
        started = time.perf_counter()
        with bar:
            for request in requests:
                if request.arrival_s is not None:  # a trace: wait for the request's arrival time
                    if request.arrival_s > args.max_seconds:
                        break
                    delay = started + request.arrival_s - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                elif time.perf_counter() - started > args.max_seconds:
                    break
                task = asyncio.create_task(one(client, request))
                task.add_done_callback(lambda _: bar.update(1))
                tasks.append(task)
                if request.arrival_s is None and args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            if len(tasks) < len(requests):
                bar.total = len(tasks)
                bar.refresh()
            results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        after = await server_counters(client, args.base_url) if before is not None else None
    counters = None
    if before is not None and after is not None:
        counters = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SERVER_COUNTERS}
    return list(results), duration, counters


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
    if "prefix_cache_hit_rate" in summary:
        rows += [("-- Server (/metrics) --", ""),
                 ("Prefix cache hit rate (%)", f"{100 * summary['prefix_cache_hit_rate']:.2f}"),
                 ("Preemptions", f"{summary['num_preemptions']}")]
    for name, value in rows:
        print(f"{name:<44}{value:>16}")
    print("=" * 60)
    for error in summary.get("errors", []):
        print(f"error: {error}")


def add_server_counters(summary: dict[str, Any], counters: dict[str, float] | None) -> None:
    if counters is None:
        return
    queries, hits = int(counters["prefix_cache_queries"]), int(counters["prefix_cache_hits"])
    summary.update({"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                    "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                    "num_preemptions": int(counters["num_preemptions"])})


def run(args: argparse.Namespace) -> int:
    from sparrow.bench.serve_args import resolve_workload_flags

    resolve_workload_flags(args)
    if args.trace_answers != "drawn" and not args.trace:
        raise ValueError("--trace-answers applies only with --trace")
    if args.trace:
        if args.request_rate is not None:
            raise ValueError("--request-rate does not apply with --trace: the trace's arrival_s times are replayed")
        requests = trace_requests(args.trace, args.num_prompts, args.vocab_size, args.seed,
                                  server_answers=args.trace_answers == "server")
        rate = f"trace {args.trace}"
    else:
        args.request_rate = float("inf") if args.request_rate is None else args.request_rate
        args.num_prompts = 64 if args.num_prompts is None else args.num_prompts
        requests = make_requests(args.num_prompts, (args.input_len_min, args.input_len_max),
                                 (args.output_len_min, args.output_len_max), args.vocab_size, args.seed)
        rate = f"rate: {args.request_rate} req/s"
    results, duration, counters = asyncio.run(run_benchmark(args, requests))
    summary = summarize(results, duration)
    add_server_counters(summary, counters)
    summary.update({
        "benchmark": "serve", "base_url": args.base_url, "request_rate": args.request_rate, "trace": args.trace,
        "trace_answers": args.trace_answers if args.trace else None,
        "num_prompts": len(requests), "max_seconds": args.max_seconds,
        "machine": f"{platform.node()} {platform.machine()}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })
    print(f"machine: {summary['machine']}  {summary['date']}  {rate}")
    print_table(summary)
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
        print(f"wrote {path}")
    return 0 if summary["failed"] == 0 else 1
