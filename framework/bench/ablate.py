"""`sparrow bench ablate`: one workload across a grid of engine settings.

Every grid point gets a fresh ``LLM`` (so no cache or warm state leaks between points), a short
warm-up, then the whole workload submitted at once (every request arrives at t0, as in an offline
batch). Per point: request and token throughput, mean / median / p99 end-to-end latency (t0 to the
request's ``metrics.finished_time``), and the prefix-cache hit rate from the engine's scheduler
stats (tokens found / tokens looked up during the run).

Workloads (docs/ablations.md):

- ``offline``: the zero-hit offline workload, random prompts of [16, 400) tokens, [16, 200) outputs;
- ``shared-prefix``: a 256-token system prefix shared by every request plus a [32, 128]-token
  unique suffix, [16, 64) outputs;
- ``mixed``: for comparing schedulers, 80% short requests ([16, 64) prompt, [8, 32) output) and
  20% long ones ([256, 512) prompt, [128, 256) output), interleaved at random.

Every request also gets a random priority in {0, 1, 2}, read only by the ``priority`` scheduler (a
real engine refuses a non-zero priority under a policy that ignores it: the others get 0).
``--trace FILE`` replays a request trace instead (``sparrow.bench.trace``): each request is submitted
at its arrival time, latencies count from that time.

``--device sim --sim-gpu h100`` runs every point on the simulated device (``sparrow.sim``): the
real scheduler and KV cache on simulated time, so a GPU-sized grid runs on a CPU in seconds per
point and the same seed gives the same table. Per point, both kinds of run report TTFT and TPOT
too. Writes ``results.md`` (table), ``results.json`` and ``results.png`` (chart) to ``--output-dir``.

Every flag, every grid value and every combination of them is checked before the first point runs
(``sparrow.bench.ablate_checks``: each point's engine configuration is built and pre-flighted,
nothing is loaded), so a mistake in the last value of a grid costs no run. A point that still
fails when it runs is a row saying why, the grid goes on, and the command exits with status 1.

Each point runs in ``sparrow.bench.ablate_point``; ``sparrow.bench.ablate_report`` writes the reports.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sparrow.bench.ablate_point import measure, run_point, run_sim_point  # noqa: F401 - re-exported
from sparrow.bench.ablate_report import COLUMNS, markdown_table, write_chart, write_report  # noqa: F401 - re-exported
from sparrow.bench.outputs import RULE as OUTPUT_RULE

logger = logging.getLogger(__name__)

WORKLOADS = ("offline", "shared-prefix", "mixed")
# (flag dest, engine argument, short label for chart and table)
AXES = (
    ("schedulers", "scheduler", "sched"),
    ("prefix_caching", "enable_prefix_caching", "pc"),
    ("max_num_batched_tokens", "max_num_batched_tokens", "mbt"),
    ("block_size", "block_size", "bs"),
    ("max_num_seqs", "max_num_seqs", "seqs"),
    ("kv_eviction_policies", "kv_eviction_policy", "evict"),
)
NUM_PRIORITIES = 3
# The tiny tokenizer keeps its special tokens at the top of the vocabulary: prompts stay below.
RESERVED_TOP_IDS = 16


@dataclass(slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int
    arrival_s: float = 0.0  # seconds after the run starts (a trace's arrival time)


# -- command line -----------------------------------------------------------------------------
def _csv(convert):
    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):  # "fcfs,,sjf" or "fcfs,": a value lost, not one to skip
            raise argparse.ArgumentTypeError(f"expected comma-separated values, none of them empty, got {text!r}")
        return [convert(part) for part in parts]
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _on_off(text: str) -> bool:
    value = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ablate", help="one workload across a grid of schedulers and engine settings")
    p.add_argument("model", nargs="?", default=None, help="local model directory (default: built-in sparrow-tiny)")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed",
                   help="offline (nothing shared), shared-prefix, or mixed (short and long requests)")
    p.add_argument("--num-prompts", type=_positive_int, default=64, help="requests in the workload")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay every request of this JSONL trace (sparrow.bench.trace) instead of --workload "
                        "and --num-prompts: arrival times, prompt and output lengths, prefix groups, priorities")
    p.add_argument("--device", default=None,
                   help="device of every engine (default: the engine's); 'sim' runs the grid on the "
                        "simulated device, in simulated time, in this process")
    p.add_argument("--sim-gpu", default=None,
                   help="the card simulated with --device sim: h100 (default), h200, a100, l40s")
    grid = p.add_argument_group("grid (comma-separated values; every combination is one point)")
    grid.add_argument("--schedulers", type=_csv(str), default="fcfs",
                      help="scheduler names, or 'all' for every registered scheduler")
    grid.add_argument("--prefix-caching", type=_csv(_on_off), default=None, help="on,off (default: engine's, on)")
    grid.add_argument("--max-num-batched-tokens", type=_csv(_positive_int), default=None,
                      help="token budgets per step (default: the platform's, CPU 2048, CUDA 8192)")
    grid.add_argument("--block-size", type=_csv(_positive_int), default=None,
                      help="KV block sizes (default: platform's)")
    grid.add_argument("--max-num-seqs", type=_csv(_positive_int), default=None,
                      help="running-batch caps (default: engine's); small values make requests queue")
    grid.add_argument("--kv-eviction-policies", type=_csv(str), default=None,
                      help="KV eviction policies, e.g. lru,lfu (default: engine's, lru; `sparrow plugins` lists them)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every prompt and output length of the workload (e.g. 0.25 for a quick run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of every engine")
    p.add_argument("--engine-args", default="{}",
                   help='JSON dict of extra engine arguments, e.g. \'{"dtype": "float32"}\'')
    p.add_argument("--multiprocess", action=argparse.BooleanOptionalAction, default=None,
                   help="engine core in its own process (default: the engine's default, yes; "
                        "--device sim always runs in this process)")
    p.add_argument("--output-dir", default="bench-results/ablate",
                   help=f"where results.md, .json and .png go ({OUTPUT_RULE})")
    p.set_defaults(func=run)
    return p


# -- workloads --------------------------------------------------------------------------------
def make_workload(name: str, num_prompts: int, vocab_size: int, seed: int = 0,
                  length_scale: float = 1.0) -> list[WorkItem]:
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    if length_scale <= 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    rng = random.Random(seed)

    def length(low: int, high: int) -> int:  # uniform in [low, high), scaled, at least 1
        return max(1, round(rng.randrange(low, high) * length_scale))

    def tokens(count: int) -> list[int]:
        return [rng.randrange(0, vocab_size - RESERVED_TOP_IDS) for _ in range(count)]

    shared_prefix = tokens(max(1, round(256 * length_scale))) if name == "shared-prefix" else []
    items = []
    for _ in range(num_prompts):
        if name == "offline":
            prompt, max_tokens = tokens(length(16, 400)), length(16, 200)
        elif name == "shared-prefix":
            prompt, max_tokens = shared_prefix + tokens(length(32, 129)), length(16, 64)
        elif rng.random() < 0.2:  # mixed, long
            prompt, max_tokens = tokens(length(256, 512)), length(128, 256)
        else:  # mixed, short
            prompt, max_tokens = tokens(length(16, 64)), length(8, 32)
        items.append(WorkItem(prompt, max_tokens, rng.randrange(NUM_PRIORITIES)))
    return items


def trace_workload(path: str, vocab_size: int, seed: int = 0) -> list[WorkItem]:
    """The requests of a trace file, with deterministic prompt ids (``prompt_tokens``)."""
    from sparrow.bench.trace import load_trace, prompt_tokens

    requests = load_trace(path)
    prompts = prompt_tokens(requests, vocab_size, seed=seed)
    return [WorkItem(prompt, request.output_len, request.priority, request.arrival_s)
            for request, prompt in zip(requests, prompts)]


# -- the grid ---------------------------------------------------------------------------------
def grid_points(axes: dict[str, list[Any] | None]) -> list[dict[str, Any]]:
    """Engine-argument dicts, one per combination; an axis left at None is not set."""
    chosen = [(arg, values) for arg, values in axes.items() if values]
    if not chosen:
        return [{}]
    names = [arg for arg, _ in chosen]
    return [dict(zip(names, combo)) for combo in itertools.product(*(values for _, values in chosen))]


def point_label(point: dict[str, Any], varying: set[str]) -> str:
    short = {arg: label for _, arg, label in AXES}
    parts = []
    for arg, value in point.items():
        if arg not in varying:
            continue
        if isinstance(value, bool):
            value = "on" if value else "off"
        parts.append(str(value) if arg == "scheduler" else f"{short.get(arg, arg)}={value}")
    return " ".join(parts) or "default"


def resolve_axes(args: argparse.Namespace) -> dict[str, list[Any] | None]:
    schedulers = args.schedulers
    if schedulers == ["all"]:
        from sparrow.plugins import get_registry

        schedulers = sorted(get_registry().schedulers)
    return {
        "scheduler": schedulers,
        "enable_prefix_caching": args.prefix_caching,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "kv_eviction_policy": args.kv_eviction_policies,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from sparrow.bench import ablate_checks as checks

    # The flags first: a mistake is reported before torch's seconds of importing.
    checks.check_flags(args)
    engine_args = checks.parse_engine_args(args.engine_args)

    import platform

    import torch

    from sparrow.engine.setup import resolve_model_path
    from sparrow.model_loader import get_hf_config

    device = checks.resolve_device(args, engine_args)
    sim_gpu = (args.sim_gpu or "h100").lower() if device == "sim" else None
    axes = resolve_axes(args)
    overlap = sorted(set(engine_args) & {arg for arg, values in axes.items() if values})
    if overlap:
        raise ValueError(f"--engine-args sets {', '.join(overlap)}, which the grid varies; use the grid flag")
    model_path = resolve_model_path(args.model)
    points = grid_points(axes)
    varying = {arg for arg, values in axes.items() if values and len(values) > 1}
    checks.check_grid(axes, {arg: "--" + dest.replace("_", "-") for dest, arg, _ in AXES}, points,
                      checks.engine_point_check(model_path, engine_args, args.seed, sim_gpu),
                      lambda point: point_label(point, set(point)))
    vocab_size = get_hf_config(model_path, bool(engine_args.get("trust_remote_code", False))).vocab_size
    if args.trace is not None:
        workload = trace_workload(args.trace, vocab_size, seed=args.seed)
    else:
        workload = make_workload(args.workload, args.num_prompts, vocab_size, seed=args.seed,
                                 length_scale=args.length_scale)
    from tqdm.auto import tqdm

    out_dir = Path(args.output_dir)
    results: list[dict[str, Any]] = []
    report = {
        "benchmark": "ablate", "workload": "trace" if args.trace else args.workload, "trace": args.trace,
        "model": model_path, "device": device, "sim_gpu": sim_gpu,
        "num_prompts": len(workload), "length_scale": args.length_scale, "seed": args.seed,
        "engine_args": engine_args,
        "axes": {arg: values for arg, values in axes.items() if values},
        "machine": f"{platform.node()} {platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "num_points": len(points), "points": results,
    }
    # Progress on stderr: one bar over the grid, and one per point over its requests.
    with tqdm(total=len(points), desc="grid points", unit="point", dynamic_ncols=True) as bar:
        for point in points:
            label = point_label(point, varying)
            bar.set_postfix_str(label)
            try:
                if sim_gpu is not None:
                    measured = run_sim_point(model_path, workload, point, engine_args, args.seed, sim_gpu)
                else:
                    measured = run_point(model_path, workload, point, engine_args, args.multiprocess, args.seed)
            except Exception as exc:  # noqa: BLE001 - one point's failure is its row; the grid goes on
                logger.error("grid point %s failed: %s: %s", label, type(exc).__name__, exc)
                measured = {"error": " ".join(f"{type(exc).__name__}: {exc}".split())}
            results.append({"label": label, "settings": point, **measured})
            write_report(report, out_dir, chart=False)  # what is measured survives a later stop
            bar.update(1)

    table, charted = write_report(report, out_dir, chart=True)
    print(table)
    print(f"wrote {out_dir / 'results.md'}, results.json" + (", results.png" if charted else
          " (no chart: matplotlib is not installed; pip install 'sparrow-llm[bench]')"))
    failed = [point["label"] for point in results if "error" in point]
    if failed:
        from sparrow.entrypoints.cli_errors import CommandFailed

        raise CommandFailed(f"{len(failed)} of {len(results)} grid points failed ({', '.join(failed)}); "
                           f"their rows in {out_dir / 'results.md'} say why")
    return report
