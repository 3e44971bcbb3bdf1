"""`sparrow bench sim`: the offline GPU workload of docs/benchmarks.md on the simulated device.

The same requests as ``sparrow bench throughput --preset gpu`` (same seed, same lengths: 256
requests, prompt and output lengths uniform in [100, 1024]) with the same engine settings
(``max_num_seqs=256``, ``max_num_batched_tokens=16384``), on Qwen3-0.6B's shapes (a directory
holding only its config.json; nothing is loaded). Prints the predicted elapsed time and
throughput, where the simulated time went by step size, and, for the H100 at the defaults, the
error against the measured H100 run of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# The measured run the cost model is calibrated against (docs/benchmarks.md, "Offline throughput
# on one CUDA GPU (H100)", 2026-11-22: 138,263 output tokens in 18.67 s).
MEASURED = {"h100": {"elapsed_s": 18.67, "output_tok_s": 7407.0,
                     "source": "docs/benchmarks.md: sparrow bench throughput --preset gpu on 1x H100 80GB HBM3, "
                               "2026-11-22"}}
ENGINE_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 16384}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from sparrow.bench.outputs import RULE as OUTPUT_RULE
    from sparrow.bench.throughput import GPU_PRESET

    p = subparsers.add_parser("sim", help="the GPU throughput workload on the simulated device (device='sim')",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (only its config.json is read; default: Qwen3-0.6B's shapes)")
    p.add_argument("--sim-gpu", default="h100", help="the card simulated: h100, h200, a100, l40s")
    p.add_argument("--num-prompts", type=int, default=GPU_PRESET["num_prompts"], help="requests in the workload")
    p.add_argument("--input-len-min", type=int, default=GPU_PRESET["input_len_min"], help="shortest prompt")
    p.add_argument("--input-len-max", type=int, default=GPU_PRESET["input_len_max"], help="prompts are below this")
    p.add_argument("--output-len-min", type=int, default=GPU_PRESET["output_len_min"], help="smallest max_tokens")
    p.add_argument("--output-len-max", type=int, default=GPU_PRESET["output_len_max"],
                   help="max_tokens values are below this")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of the simulated tokens")
    p.add_argument("--engine-args", default="{}",
                   help=f"JSON dict of engine arguments (defaults: {json.dumps(ENGINE_DEFAULTS)}); "
                        '"additional_config" sets sim_step_overhead_s / sim_token_overhead_s')
    p.add_argument("--measured-elapsed", type=float, default=None,
                   help="a measured elapsed time (s) of the same workload to compare with (default: the "
                        "calibration run's, for the H100 at the default workload)")
    p.add_argument("--result-file", default="bench-results/sim.json",
                   help=f"JSON report path, '' for none ({OUTPUT_RULE})")
    p.set_defaults(func=run)
    return p


def qwen3_0_6b_config_dir(out_dir: Path) -> Path:
    """A directory holding only Qwen3-0.6B's config.json: all the simulated device reads."""
    from sparrow.bench.gpu import QWEN3_0_6B, QWEN3_0_6B_VOCAB

    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
              "torch_dtype": "bfloat16", "vocab_size": QWEN3_0_6B_VOCAB, **QWEN3_0_6B}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "config.json"
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return out_dir


def _is_default_workload(args: argparse.Namespace) -> bool:
    from sparrow.bench.throughput import GPU_PRESET

    return (args.model is None and args.seed == 0 and args.engine_args_dict == {}
            and all(getattr(args, name) == value for name, value in GPU_PRESET.items() if name != "temperature"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from sparrow.bench.throughput import check_args, make_workload
    from sparrow.model_loader import get_hf_config
    from sparrow.sim import SimRequest, simulate
    from sparrow.tiny.model import cache_root

    args.repeats, args.hf_num_prompts, args.hf_batch_size = 1, None, None  # what check_args also reads
    args.engine_args_dict = check_args(args)
    if args.measured_elapsed is not None and args.measured_elapsed <= 0:
        raise ValueError(f"--measured-elapsed must be > 0, got {args.measured_elapsed}")
    model = args.model or str(qwen3_0_6b_config_dir(cache_root() / "qwen3-0.6b-config"))
    # The throughput benchmark draws prompt ids below 4,096 (its small tokenizer's vocabulary).
    engine_args = {**ENGINE_DEFAULTS, **args.engine_args_dict}
    hf_config = get_hf_config(model, bool(engine_args.get("trust_remote_code", False)))
    workload = make_workload(args, min(hf_config.vocab_size, 4096))
    requests = [SimRequest(prompt, max_tokens) for prompt, max_tokens in workload]
    result = simulate(model, requests, sim_gpu=args.sim_gpu, seed=args.seed, **engine_args)
    summary = result.summary()
    measured = args.measured_elapsed
    source = "--measured-elapsed"
    if measured is None and _is_default_workload(args) and result.gpu in MEASURED:
        measured, source = MEASURED[result.gpu]["elapsed_s"], MEASURED[result.gpu]["source"]
    report: dict[str, Any] = {
        "benchmark": "sim", "sim_gpu": result.gpu, "model": model, "num_prompts": len(requests),
        "seed": args.seed, "engine_args": engine_args, "summary": summary,
        "step_buckets": {str(k): {"steps": v[0], "seconds": v[1]} for k, v in result.step_buckets.items()},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if measured is not None:
        report.update(measured_elapsed_s=measured, measured_source=source,
                      error=(summary["elapsed_s"] - measured) / measured)
    print_report(report)
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.result_file}")
    return report


def print_report(report: dict[str, Any]) -> None:
    summary = report["summary"]
    rows = [
        ("simulated card", report["sim_gpu"]),
        ("requests", f"{report['num_prompts']}"),
        ("prompt / output tokens", f"{summary['prompt_tokens']} / {summary['output_tokens']}"),
        ("KV cache blocks", f"{summary['num_kv_blocks']}"),
        ("engine steps", f"{summary['num_steps']}"),
        ("predicted elapsed (s)", f"{summary['elapsed_s']:.2f}"),
        ("predicted output tok/s", f"{summary['output_tok_s']:.1f}"),
        ("TTFT mean / p99 (s)", f"{summary['mean_ttft_s']:.3f} / {summary['p99_ttft_s']:.3f}"),
        ("TPOT mean / p99 (ms)", f"{1000 * summary['mean_tpot_s']:.2f} / {1000 * summary['p99_tpot_s']:.2f}"),
        ("prefix hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"),
        ("preemptions", f"{summary['num_preemptions']}"),
    ]
    if "measured_elapsed_s" in report:
        rows += [("measured elapsed (s)", f"{report['measured_elapsed_s']:.2f} ({report['measured_source']})"),
                 ("error", f"{100 * report['error']:+.1f} %")]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("  simulated time by step size (tokens per step <=): steps, seconds")
    for bucket, figures in report["step_buckets"].items():
        print(f"    {bucket:>6}  {figures['steps']:>5}  {figures['seconds']:.3f}")
