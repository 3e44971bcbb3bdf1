"""A discrete-event driver on simulated time: the real engine core in this process, over the
simulated device.

The driver admits each request when the simulated clock reaches its arrival time, runs one engine
step, and advances the clock by the step's simulated duration (``SimWorker.last_step``); tokens
of a step are stamped with the clock at the step's end. With nothing to run, the clock jumps to
the next arrival. Nothing here reads the wall clock, so two runs with the same seed produce the
same numbers on any machine::

    from sparrow.sim import SimRequest, simulate
    result = simulate(MODEL_DIR, [SimRequest(list(range(1, 100)), max_tokens=50)], sim_gpu="h100")
    result.summary()["output_tok_s"]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sparrow.config import ConfigError, EngineConfig
from sparrow.sampling_params import SamplingParams
from sparrow.wire import EngineCoreRequest

# Requests' arrival_time on the engine core's clock: the simulated seconds, offset so that an
# arrival at 0 is not read as "unset" (EngineCoreRequest's default, replaced by the wall clock).
ARRIVAL_EPOCH = 1.0


@dataclass(frozen=True, slots=True)
class SimRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos)
    arrival_s: float = 0.0  # simulated seconds after the run starts
    priority: int = 0


@dataclass(slots=True)
class RequestTiming:
    """One request's simulated times, in seconds after the run started."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for a one-token output."""
        if self.num_output_tokens < 2 or self.finish_s is None or self.first_token_s is None:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class SimResult:
    gpu: str
    requests: list[RequestTiming]
    elapsed_s: float  # simulated: from the run's start to the last request's finish
    num_steps: int
    busy_s: float  # simulated time spent in steps (the rest waited for arrivals)
    num_kv_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # (num_tokens bucket upper bound) -> [steps, simulated seconds]: where the time went.
    step_buckets: dict[int, list[float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The figures ``sparrow bench ablate`` reports per point (the same keys)."""
        import numpy as np

        def stats(name: str, values: list[float]) -> dict[str, float]:
            array = np.array(values or [0.0])
            return {f"mean_{name}": float(array.mean()), f"median_{name}": float(np.percentile(array, 50)),
                    f"p99_{name}": float(np.percentile(array, 99))}

        elapsed = self.elapsed_s or float("nan")
        prompt_tokens = sum(r.num_prompt_tokens for r in self.requests)
        output_tokens = sum(r.num_output_tokens for r in self.requests)
        return {
            "elapsed_s": self.elapsed_s,
            "request_throughput": len(self.requests) / elapsed,
            "output_tok_s": output_tokens / elapsed,
            "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
            **stats("e2e_s", [r.finish_s - r.arrival_s for r in self.requests if r.finish_s is not None]),
            **stats("ttft_s", [r.ttft_s for r in self.requests if r.first_token_s is not None]),
            **stats("tpot_s", [tpot for r in self.requests if (tpot := r.tpot_s) is not None]),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hits / self.prefix_cache_queries
            if self.prefix_cache_queries else 0.0,
            "cached_prompt_tokens": sum(r.num_cached_tokens for r in self.requests),
            "num_preemptions": self.num_preemptions,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "num_steps": self.num_steps,
            "num_kv_blocks": self.num_kv_blocks,
        }


def sim_engine_config(model: str | None = None, *, sim_gpu: str = "h100", seed: int = 0,
                      **engine_args: Any) -> EngineConfig:
    """A finalized configuration for ``device="sim"``: what ``finalize_config`` does, without the
    tokenizer the frontend needs (the driver sends token ids), so a directory holding only a
    config.json is enough."""
    from sparrow.engine.preflight import (
        apply_platform_config,
        check_budgets,
        check_platform_settings,
        check_plugin_names,
        resolve_configured_platform,
    )
    from sparrow.engine.setup import resolve_model_path
    from sparrow.model_loader import get_hf_config, get_max_model_len
    from sparrow.plugins import get_registry

    device = engine_args.pop("device", "sim")
    if device != "sim":
        raise ConfigError(f"invalid engine argument 'device': the simulation driver runs device 'sim', got {device!r}")
    additional = {"sim_gpu": sim_gpu, **dict(engine_args.pop("additional_config", None) or {})}
    config = EngineConfig.from_kwargs(device="sim", seed=seed, additional_config=additional, **engine_args)
    model_path = resolve_model_path(model)
    hf_config = get_hf_config(model_path, config.model.trust_remote_code, config.model.hf_overrides)
    model_max = get_max_model_len(hf_config)
    max_model_len = config.model.max_model_len or model_max
    if max_model_len > model_max:
        raise ConfigError(f"invalid engine argument 'max_model_len': {max_model_len} exceeds the model's "
                          f"maximum {model_max}")
    config.model = config.model.model_copy(update={
        "model": model_path, "tokenizer": config.model.tokenizer or model_path, "max_model_len": max_model_len})
    registry = get_registry()
    check_plugin_names(config, registry)
    platform = resolve_configured_platform("sim", registry)
    config = apply_platform_config(config, platform)
    if config.scheduler.max_num_batched_tokens is None:
        config.scheduler.max_num_batched_tokens = platform.default_max_num_batched_tokens
    check_platform_settings(config, platform, hf_config)
    check_budgets(config)
    return config


def bucket_of(num_tokens: int) -> int:
    """Step-size buckets: powers of two (1, 2, 4, ... tokens)."""
    return 1 << max(0, (num_tokens - 1).bit_length())


def simulate(model: str | None, requests: Sequence[SimRequest], *, sim_gpu: str = "h100", seed: int = 0,
             **engine_args: Any) -> SimResult:
    """Run ``requests`` through a fresh engine core on the simulated ``sim_gpu``."""
    from sparrow.engine.core import EngineCore

    config = sim_engine_config(model, sim_gpu=sim_gpu, seed=seed, **engine_args)
    core = EngineCore(config)
    try:
        return _run(core, config, requests)
    finally:
        core.shutdown()


def _engine_request(index: int, request: SimRequest, max_model_len: int) -> EngineCoreRequest:
    request_id = f"sim-{index}"
    prompt_len = len(request.prompt_token_ids)
    if prompt_len + request.max_tokens > max_model_len:
        raise ValueError(f"request {index}: {prompt_len} prompt tokens + max_tokens {request.max_tokens} exceed "
                         f"max_model_len={max_model_len}")
    params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=list(request.prompt_token_ids),
                             sampling_params=params, arrival_time=ARRIVAL_EPOCH + request.arrival_s,
                             priority=request.priority, max_tokens=request.max_tokens)


def _run(core: Any, config: EngineConfig, requests: Sequence[SimRequest]) -> SimResult:
    worker = core.executor.worker
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)  # stable: ties keep their order
    max_model_len = config.model.max_model_len or 0
    timings: dict[str, RequestTiming] = {}
    clock = busy = 0.0
    num_steps = next_arrival = 0
    buckets: dict[int, list[float]] = {}
    while next_arrival < len(order) or core.has_unfinished_requests():
        while next_arrival < len(order) and requests[order[next_arrival]].arrival_s <= clock:
            index = order[next_arrival]
            request = requests[index]
            engine_request = _engine_request(index, request, max_model_len)
            core.add_request(engine_request)
            timings[engine_request.request_id] = RequestTiming(engine_request.request_id, request.arrival_s,
                                                               len(request.prompt_token_ids))
            next_arrival += 1
        if not core.has_unfinished_requests():
            clock = requests[order[next_arrival]].arrival_s  # idle until the next arrival
            continue
        steps_before = worker.num_steps
        outputs = core.step()
        if worker.num_steps == steps_before:
            # Nothing could be scheduled (the cache is full of requests that wait for others):
            # only a new arrival can change that.
            if next_arrival == len(order):
                raise RuntimeError("the simulated engine scheduled nothing with no arrival left to wait for")
            clock = max(clock, requests[order[next_arrival]].arrival_s)
            continue
        step = worker.last_step
        clock += step.duration_s
        busy += step.duration_s
        num_steps += 1
        bucket = buckets.setdefault(bucket_of(step.num_tokens), [0, 0.0])
        bucket[0] += 1
        bucket[1] += step.duration_s
        for output in outputs.outputs:
            if output.error_message is not None:
                raise ValueError(f"request {output.request_id}: {output.error_message}")
            timing = timings[output.request_id]
            if output.new_token_ids:
                if timing.first_token_s is None:
                    timing.first_token_s = clock
                timing.num_output_tokens += len(output.new_token_ids)
            if output.finished:
                timing.finish_s = clock
                timing.num_cached_tokens = output.num_cached_tokens
    stats = core.scheduler.make_stats()
    return SimResult(
        gpu=worker.settings.gpu.name, requests=[timings[f"sim-{i}"] for i in range(len(requests))],
        elapsed_s=clock, num_steps=num_steps, busy_s=busy, num_kv_blocks=core.num_kv_blocks,
        block_size=core.block_size, prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, num_preemptions=stats.num_preemptions,
        step_buckets=dict(sorted(buckets.items())))
