"""`sparrow bench throughput`: the offline CPU workload of docs/benchmarks.md, optionally against HF.

Workload: random token-id prompts with lengths uniform in [input_len_min, input_len_max), per-request
max_tokens uniform in [output_len_min, output_len_max), ignore_eos, greedy. The HF reference runs
`generate` in the same process on the same prompts, in left-padded batches of ``--hf-batch-size``
(default: one batch of all) one after another, each with max_new_tokens = the batch's largest
max_tokens, counting only the tokens each request asked for.

A ratio of throughputs is only a speed-up when both sides ran the same workload. ``--hf-num-prompts N``
runs HF on the first N prompts only: its figure is reported as per-batch throughput of that subset
and no ratio is printed or stored.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import time
from datetime import datetime, timezone
from typing import Any

from sparrow.bench.ablate_checks import parse_engine_args
from sparrow.bench.outputs import RULE as OUTPUT_RULE
from sparrow.bench.workload_flags import check_length_ranges, resolve_lengths

logger = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput on a random-token workload",
                              description="Offline throughput of the engine on random token-id prompts "
                                          "(docs/benchmarks.md), optionally against HF transformers.")
    p.add_argument("model", nargs="?", default=None, help="local model directory (default: built-in sparrow-tiny)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    p.add_argument("--input-len-min", type=int, default=None,
                   help="shortest prompt, in tokens (default: 16; 100 with --preset gpu)")
    p.add_argument("--input-len-max", type=int, default=None,
                   help="prompt lengths are below this (default: 400; 1025 with --preset gpu)")
    p.add_argument("--output-len-min", type=int, default=None,
                   help="smallest max_tokens of a request (default: 16; 100 with --preset gpu)")
    p.add_argument("--output-len-max", type=int, default=None,
                   help="max_tokens values are below this (default: 200; 1025 with --preset gpu)")
    p.add_argument("--input-len", type=int, default=None,
                   help="every prompt this long, as vLLM's --input-len (instead of --input-len-min/-max)")
    p.add_argument("--output-len", type=int, default=None,
                   help="every request's max_tokens, as vLLM's --output-len (instead of --output-len-min/-max)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of the engine")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers generate on the same prompts and print the speed-up")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF runs the whole workload in batches of this many prompts, one after another "
                        "(default: one batch of all; 32 with --preset gpu)")
    p.add_argument("--hf-num-prompts", type=int, default=None,
                   help="a quicker, reduced HF run on the first N prompts only, reported as per-batch "
                        "throughput and not as a speed-up (default: all prompts)")
    p.add_argument("--repeats", type=int, default=1, help="runs of the engine (the median is reported)")
    p.add_argument("--result-file", default="bench-results/throughput.json",
                   help=f"JSON report path, '' for none ({OUTPUT_RULE})")
    p.add_argument("--engine-args", default="{}",
                   help='JSON dict of extra engine arguments, e.g. \'{"max_num_seqs": 64}\'')
    p.add_argument("--quantization", default=None,
                   help="quantization method of the engine (e.g. int8 on the CPU; the same as "
                        "--engine-args '{\"quantization\": ...}')")
    p.add_argument("--structured-outputs", choices=("none", "json"), default="none",
                   help="json: constrain every request to a JSON array of strings too long to end before its "
                   "max_tokens, so outputs are as long as unconstrained ones (structured outputs' overhead)")
    p.add_argument("--profile", action="store_true",
                   help="one more, untimed run of the workload under torch.profiler: reports the device's busy "
                        "fraction (a GPU's kernels' time over the run's wall time) and, with "
                        "SPARROW_TORCH_PROFILER_DIR set, writes each rank's Chrome trace there")
    p.add_argument("--preset", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: Qwen3-0.6B-shaped random bf16 model, 256 requests, lengths 100-1024, temperature 0.6")
    p.set_defaults(func=run)


GPU_PRESET = dict(num_prompts=256, input_len_min=100, input_len_max=1025, output_len_min=100,
                  output_len_max=1025, temperature=0.6)


CPU_LENGTHS = dict(input_len_min=16, input_len_max=400, output_len_min=16, output_len_max=200)


def apply_lengths(args: argparse.Namespace) -> None:
    """--input-len / --output-len (vLLM's fixed lengths) or the ranges, else the preset's ranges."""
    lengths = {name: GPU_PRESET[name] for name in CPU_LENGTHS} if args.preset == "gpu" else CPU_LENGTHS
    for kind in ("input", "output"):
        resolve_lengths(args, kind, getattr(args, f"{kind}_len", None), f"--{kind}-len", lengths)


def apply_preset(args: argparse.Namespace) -> dict:
    """Fill the workload's defaults (the GPU preset's with --preset gpu); returns extra engine
    arguments."""
    apply_lengths(args)
    if args.preset != "gpu":
        return {}
    defaults = {"num_prompts": 64, "temperature": 0.0}
    for name, value in defaults.items():
        if getattr(args, name) == value:
            setattr(args, name, GPU_PRESET[name])
    # HF's single left-padded batch of 256 prompts of up to 2,048 tokens would not fit the card's
    # memory: the same prompts run as sequential batches instead.
    if args.hf_batch_size is None:
        args.hf_batch_size = 32
    return {"device": "cuda", "max_num_seqs": 256, "max_num_batched_tokens": 16384}


def check_args(args: argparse.Namespace) -> dict[str, Any]:
    """Refuse impossible flags before anything loads; returns the parsed --engine-args."""
    for flag in ("num_prompts", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    check_length_ranges(args)
    for flag in ("hf_num_prompts", "hf_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    engine_args = parse_engine_args(args.engine_args)
    if getattr(args, "quantization", None) is not None:
        engine_args["quantization"] = args.quantization
    return engine_args


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    workload = []
    for _ in range(args.num_prompts):
        prompt_len = rng.randrange(args.input_len_min, args.input_len_max)
        max_tokens = rng.randrange(args.output_len_min, args.output_len_max)
        # Avoid the top of the vocabulary, where the tiny tokenizer keeps special tokens.
        prompt = [rng.randrange(0, vocab_size - 16) for _ in range(prompt_len)]
        workload.append((prompt, max_tokens))
    return workload


def measure_matmul_flops(dtype_name: str = "float32", size: int = 1024, repeats: int = 10) -> float:
    """Sustained FLOP/s of a square matmul in this process (the roofline's denominator).

    The best of torch.mm (MKL) and, where available, oneDNN with a pre-packed weight (what the
    CPU plugin's linear layers use): the roofline is the fastest matmul this machine offers.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    candidates = [lambda: torch.mm(a, b)]
    if (dtype == torch.float32 and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.backends.mkldnn.is_available()):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous())
        candidates.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for matmul in candidates:
        matmul()
        for _ in range(repeats):
            started = time.perf_counter()
            matmul()
            best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def run_engine(model_path: str, workload, args, engine_args: dict) -> dict[str, Any]:
    from sparrow import LLM, SamplingParams

    llm = LLM(model=model_path, seed=args.seed, **engine_args)
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in workload]
    # The GPU model's vocabulary is wider than its small tokenizer: no text, only token ids.
    detokenize = args.preset != "gpu"
    structured = None
    if getattr(args, "structured_outputs", "none") == "json":
        from sparrow.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(json={"type": "array", "items": {"type": "string"}, "minItems": 1000})
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=args.temperature, seed=args.seed + i,
                             detokenize=detokenize, structured_outputs=structured) for i, (_, m) in enumerate(workload)]
    from sparrow.bench.machine_load import LoadMeter, probe_speed

    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    times, loads, meter = [], [], LoadMeter()
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # random prompts share nothing, but runs must not share either
        meter.start()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)  # the bar goes to stderr
        times.append(time.perf_counter() - started)
        load = meter.stop()
        if load is not None and args.repeats > 1 and args.preset != "gpu":
            load["probe_flops"] = probe_speed()  # the machine's own speed just after the run
        loads.append(load)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_params = llm.num_parameters()
    profile = None
    if getattr(args, "profile", False):  # after the timed runs: the profiler's overhead stays out of them
        llm.reset_prefix_cache()
        llm.start_profile()
        llm.generate(prompts, params, use_tqdm=False)
        profile = llm.stop_profile()
    llm.shutdown()
    elapsed = sorted(times)[len(times) // 2]
    return {"elapsed_s": elapsed, "all_elapsed_s": times, "output_tokens": num_output, "num_params": num_params,
            "machine_load": loads, "profile": profile}


def run(args: argparse.Namespace) -> dict[str, Any]:
    # The flags first: a mistake is reported before torch's seconds of importing.
    engine_args = {**apply_preset(args), **check_args(args)}

    import torch

    from sparrow.engine.setup import resolve_model_path
    from sparrow.model_loader import get_hf_config

    if args.preset == "gpu" and args.model is None:
        from sparrow.bench.gpu import build_qwen3_0_6b
        from sparrow.tiny.model import cache_root

        model_path = str(build_qwen3_0_6b(cache_root() / "qwen3-0.6b-random"))
    else:
        model_path = resolve_model_path(args.model)
    hf_config = get_hf_config(model_path, bool(engine_args.get("trust_remote_code", False)),
                              engine_args.get("hf_overrides"))
    workload = make_workload(args, min(hf_config.vocab_size, 4096))
    num_prompt_tokens = sum(len(p) for p, _ in workload)
    # This VM's sustained FLOP/s drifts (noisy neighbours): measure before and after the run and
    # keep the best, so the roofline is the machine's capability, never a slow moment of it.
    flops_before = measure_matmul_flops() if args.preset != "gpu" else 0.0
    engine = run_engine(model_path, workload, args, engine_args)
    total_tokens = num_prompt_tokens + engine["output_tokens"]
    if args.preset == "gpu":
        from sparrow.bench.gpu import measure_copy_bandwidth, memory_roofline_bytes

        flops = measure_copy_bandwidth()  # bytes/s: the roofline is a memory roofline on the GPU
        roofline = memory_roofline_bytes(hf_config, workload)
        roofline_s = roofline["total_bytes"] / flops
    else:
        flops = max(flops_before, measure_matmul_flops())
        roofline_s = total_tokens * 2 * engine["num_params"] / flops
    result: dict[str, Any] = {
        "benchmark": "throughput", "model": model_path, "num_prompts": len(workload),
        "engine_args": engine_args,
        # The switches that change which kernels run (SPARROW_CPU_PACKED_LINEAR=0, ...).
        "sparrow_env": {name: value for name, value in sorted(os.environ.items()) if name.startswith("SPARROW_")},
        "prompt_tokens": num_prompt_tokens, "output_tokens": engine["output_tokens"],
        "engine_elapsed_s": engine["elapsed_s"], "engine_all_elapsed_s": engine["all_elapsed_s"],
        # Per run: cores' worth of CPU other processes and the hypervisor took (0.0 on a quiet machine).
        "engine_machine_load": engine["machine_load"],
        "engine_output_tok_s": engine["output_tokens"] / engine["elapsed_s"],
        "engine_total_tok_s": total_tokens / engine["elapsed_s"],
        "num_params": engine["num_params"], "matmul_flops": flops,
        "roofline_s": roofline_s, "roofline_share": roofline_s / engine["elapsed_s"],
        "machine": f"{platform.node()} {platform.machine()} {torch.get_num_threads()} threads",
        "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if args.preset == "gpu":
        result["roofline"] = "memory: bytes of weights + KV read by every decode step / copy bandwidth"
        result["roofline_bytes"] = roofline["total_bytes"]
        result["copy_bandwidth_bytes_s"] = flops
        result["device_name"] = torch.cuda.get_device_name()
    if engine["profile"] is not None:
        result["profile"] = engine["profile"]  # one summary per rank (sparrow.worker.profiler)
    if args.compare_hf:
        from sparrow.bench.throughput_hf import compare_hf

        result.update(compare_hf(model_path, workload, args, result["engine_output_tok_s"],
                                 trust_remote_code=bool(engine_args.get("trust_remote_code", False)),
                                 hf_overrides=engine_args.get("hf_overrides")))
    print_table(result)
    if args.result_file:
        from pathlib import Path

        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.result_file}")
    return result


def print_table(result: dict[str, Any]) -> None:
    rows = [
        ("requests", f"{result['num_prompts']}"),
        ("prompt / output tokens", f"{result['prompt_tokens']} / {result['output_tokens']}"),
        ("sparrow elapsed (s)", f"{result['engine_elapsed_s']:.2f}"),
        ("sparrow output tok/s", f"{result['engine_output_tok_s']:.1f}"),
        ("sparrow total tok/s", f"{result['engine_total_tok_s']:.1f}"),
        ("params", f"{result['num_params'] / 1e6:.1f} M"),
        ("copy GB/s" if "roofline_bytes" in result else "matmul fp32 GFLOP/s", f"{result['matmul_flops'] / 1e9:.1f}"),
        ("roofline share", f"{100 * result['roofline_share']:.1f} %"),
    ]
    if result.get("profile"):
        first = result["profile"][0]
        busy = first["device_busy_fraction"]
        rows.append(("device busy (profiled run)", f"{100 * busy:.1f} % of {first['wall_s']:.2f} s"
                     if busy is not None else f"n/a on {first['device']} (no device kernels to time)"))
    if "hf_elapsed_s" in result:
        same = result["hf_same_workload"]
        scope = "same prompts" if same else f"first {result['hf_num_prompts']} of {result['num_prompts']} prompts"
        batches = f"batches of {result['hf_batch_size']}"
        rows += [
            ("HF prompts", f"{result['hf_num_prompts']} ({scope}, {batches})"),
            ("HF elapsed (s)", f"{result['hf_elapsed_s']:.2f}"),
            ("HF output tok/s" if same else "HF per-batch output tok/s", f"{result['hf_output_tok_s']:.1f}"),
            ("HF total tok/s" if same else "HF per-batch total tok/s", f"{result['hf_total_tok_s']:.1f}"),
        ]
        if same:
            rows.append(("speed-up vs HF (same workload)", f"{result['speedup_vs_hf']:.2f}x"))
        else:
            rows.append(("vs HF", "not compared: HF ran a subset (drop --hf-num-prompts for a ratio)"))
    loads = [load for load in result.get("engine_machine_load") or [] if load is not None]
    if loads:
        busiest = max(loads, key=lambda load: load["others_cores"] + load["steal_cores"])
        rows.insert(3, ("other load (cores, busiest run)",
                        f"{busiest['others_cores']:.2f} other processes, {busiest['steal_cores']:.2f} stolen"))
    if len(result.get("engine_all_elapsed_s") or []) > 1:
        times = result["engine_all_elapsed_s"]
        probes = [load.get("probe_flops") if load else None for load in result.get("engine_machine_load") or []]
        if len(probes) == len(times) and all(probes):
            # Each run's time x the machine's speed just after it: steady when only the machine drifted.
            work = [t * p for t, p in zip(times, probes)]
            rows.insert(3, ("machine speed after each run", f"{min(probes) / 1e9:.1f}-{max(probes) / 1e9:.1f} "
                            f"GFLOP/s; runs x speed: slowest/fastest {max(work) / min(work):.2f}"))
        rows.insert(3, ("runs (s)", f"{len(times)}: {min(times):.2f}-{max(times):.2f}, "
                                    f"slowest/fastest {max(times) / min(times):.2f}"))
    width = max(len(name) for name, _ in rows)
    print(f"machine: {result['machine']} {result.get('device_name', '')}  torch {result['torch']}  {result['date']}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    # vLLM's summary line, for scripts that read it.
    print(f"Throughput: {result['num_prompts'] / result['engine_elapsed_s']:.2f} requests/s, "
          f"{result['engine_total_tok_s']:.2f} total tokens/s, {result['engine_output_tok_s']:.2f} output tokens/s")
