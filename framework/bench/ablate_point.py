"""Running one point of `sparrow bench ablate`'s grid: a fresh ``LLM`` warmed up and measured
(:func:`run_point`, :func:`measure`), or a fresh engine core on the simulated device
(:func:`run_sim_point`).

``measure`` submits each request at its arrival time, steps the engine until all finish, and
returns the point's throughput, latency percentiles (E2E, TTFT, TPOT), prefix-cache hit rate and
preemptions. ``sparrow.bench.ablate`` re-exports ``run_point``, ``run_sim_point`` and ``measure``,
and its ``run`` looks the first two up in its own namespace (tests replace them there).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparrow.bench.ablate import WorkItem


def run_sim_point(model_path: str, workload: list[WorkItem], point: dict[str, Any], engine_args: dict[str, Any],
                  seed: int, sim_gpu: str) -> dict[str, Any]:
    """One point on the simulated device: a fresh engine core, simulated time (sparrow.sim)."""
    from sparrow.sim import SimRequest, simulate

    requests = [SimRequest(item.prompt_token_ids, item.max_tokens, item.arrival_s, item.priority) for item in workload]
    return simulate(model_path, requests, sim_gpu=sim_gpu, seed=seed, **{**engine_args, **point}).summary()


def run_point(model_path: str, workload: list[WorkItem], point: dict[str, Any], engine_args: dict[str, Any],
              multiprocess: bool | None, seed: int) -> dict[str, Any]:
    from sparrow import LLM, SamplingParams

    kwargs = {**engine_args, **point, "seed": seed}
    if multiprocess is not None:
        kwargs["multiprocess"] = multiprocess
    llm = LLM(model=model_path, **kwargs)
    try:
        warm_up = [{"prompt_token_ids": item.prompt_token_ids[:8]} for item in workload[:2]]
        llm.generate(warm_up, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        llm.reset_prefix_cache()  # the measured run starts from an empty cache
        return measure(llm.llm_engine, workload, send_priority=_uses_priority(llm.llm_engine.config))
    finally:
        llm.shutdown()


def _uses_priority(config: Any) -> bool:
    from sparrow.plugins import get_registry, resolve_parser

    scheduler = config.scheduler.scheduler
    return bool(getattr(resolve_parser("scheduler", scheduler, get_registry().schedulers), "uses_priority", False))


def measure(engine: Any, workload: list[WorkItem], send_priority: bool = True) -> dict[str, Any]:
    """Submit each request at its arrival time (all at t0 for the built-in workloads) and step the
    engine until every request finishes; latencies count from each request's arrival time. Without
    ``send_priority`` every request goes at priority 0."""
    import numpy as np
    from tqdm.auto import tqdm

    from sparrow import SamplingParams

    # Scheduler counters are cumulative: the run's share is the last snapshot minus the first.
    start_stats = engine.last_stats
    finished: dict[str, Any] = {}  # request id -> final RequestOutput
    order = sorted(range(len(workload)), key=lambda index: workload[index].arrival_s)
    arrivals: dict[str, float] = {}  # request id -> its arrival, seconds after t0
    next_arrival = 0
    bar = tqdm(total=len(workload), desc="requests", unit="req", leave=False, dynamic_ncols=True)
    t0 = time.monotonic()
    while next_arrival < len(order) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while next_arrival < len(order) and workload[order[next_arrival]].arrival_s <= now:
            index = order[next_arrival]
            item = workload[index]
            params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True, temperature=0.0)
            engine.add_request(f"ablate-{index}", {"prompt_token_ids": item.prompt_token_ids}, params,
                               priority=item.priority if send_priority else 0)
            arrivals[f"ablate-{index}"] = item.arrival_s
            next_arrival += 1
        if not engine.has_unfinished_requests():
            # Idle until the next arrival: the engine has nothing to step.
            time.sleep(max(0.0, workload[order[next_arrival]].arrival_s - (time.monotonic() - t0)))
            continue
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
                bar.update(1)
    elapsed = time.monotonic() - t0
    bar.close()
    end_stats = engine.last_stats

    def counted(name: str) -> int:
        end = getattr(end_stats, name) if end_stats is not None else 0
        return end - (getattr(start_stats, name) if start_stats is not None else 0)

    queries, hits = counted("prefix_cache_queries"), counted("prefix_cache_hits")
    preemptions = counted("num_preemptions")
    if len(finished) != len(workload):
        raise RuntimeError(f"only {len(finished)} of {len(workload)} requests finished")

    def stats(name: str, values: list[float]) -> dict[str, float | None]:
        if not values:
            return {f"mean_{name}": None, f"median_{name}": None, f"p99_{name}": None}
        array = np.array(values)
        return {f"mean_{name}": float(array.mean()), f"median_{name}": float(np.percentile(array, 50)),
                f"p99_{name}": float(np.percentile(array, 99))}

    outputs = finished.values()
    e2e = [out.metrics.finished_time - t0 - arrivals[out.request_id] for out in outputs]
    ttft = [out.metrics.first_token_time - t0 - arrivals[out.request_id] for out in outputs
            if out.metrics.first_token_time is not None]
    tpot = [gap for out in outputs if (gap := out.metrics.mean_inter_token_latency) is not None]
    prompt_tokens = sum(len(item.prompt_token_ids) for item in workload)
    output_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    return {
        "elapsed_s": elapsed,
        "request_throughput": len(workload) / elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        **stats("e2e_s", e2e), **stats("ttft_s", ttft), **stats("tpot_s", tpot),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "cached_prompt_tokens": sum(out.num_cached_tokens or 0 for out in outputs),
        "num_preemptions": preemptions,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }
