#!/usr/bin/env bash
# Everything docs/benchmarks.md needs from a GPU machine, in one run: the CUDA tests, the GPU
# throughput benchmark against HF, and a profile of the decode steps. Results go to OUTDIR.
#
# Usage (repository root, on a machine with torch + CUDA):
#   scripts/gpu_checks.sh [OUTDIR] [WHEELHOUSE] [STAGES]
# WHEELHOUSE (optional, "" for none): wheels from scripts/build_wheelhouse.py --flat-target,
# installed into a private target directory first (for air-gapped machines whose image lacks
# Sparrow's other deps).
# STAGES (optional, default all): a comma-separated subset of tests,bench,profile,async,flashinfer, so that a
# machine that limits each command's time (10 minutes on the device tool) runs them in two calls,
# e.g. "tests" then "bench,profile,async".
set -uo pipefail
out=${1:-gpu-results}
wheels=${2:-}
stages=",${3:-tests,bench,profile,async,flashinfer},"
want() { [[ "$stages" == *",$1,"* ]]; }
mkdir -p "$out"
if [ -n "$wheels" ]; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" . || exit 1
  export PYTHONPATH="$site"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null || echo "flashinfer: not installed"
  date -u
} | tee "$out/machine.txt"
# 1. Every CUDA test (graph vs eager, KV fill, bf16 parity, Triton/FlashInfer kernels, the
#    persistent input buffers, overlapped scheduling, LoRA and MoE kernels).
want tests && { python3 -m pytest -q -p no:cacheprovider -m cuda tests/ \
  2>&1 | tee "$out/cuda_tests.log" | tail -25; }
# 2. The GPU benchmark of BENCHMARKS.md with HF on the same card; --profile adds an untimed run
#    under torch.profiler and prints the device's busy fraction over it.
want bench && { python3 -m sparrow.entrypoints.cli --log-level INFO bench throughput --preset gpu --compare-hf \
  --profile --result-file "$out/gpu_bench.json" > "$out/gpu_bench.log" 2>&1
echo "bench exit code $?"; grep -v "Loading weights" "$out/gpu_bench.log" | tail -20; }
# 3. Where a decode step's time goes.
want profile && { python3 scripts/profile_gpu.py --trace "$out/gpu_trace.json" 2>&1 | tee "$out/profile.txt" \
  | grep -v "^USDT" | head -40; }
# 4. The same benchmark with overlapped scheduling and the device-side token feed (#14): compare
#    its output tok/s with step 2's (docs/benchmarks.md predicts 10-25 % more).
want async && { python3 -m sparrow.entrypoints.cli --log-level INFO bench throughput --preset gpu \
  --engine-args '{"async_scheduling": true}' --profile --result-file "$out/gpu_bench_async.json" \
  > "$out/gpu_bench_async.log" 2>&1
echo "async bench exit code $?"; grep -v "Loading weights" "$out/gpu_bench_async.log" | tail -12; }
# 5. The same benchmark on the FlashInfer backend (#14 asks for both backends, same card, same day).
#    Its decode steps replay graphs re-planned before each replay; its mixed steps run eagerly.
want flashinfer && { if python3 -c "import flashinfer" 2>/dev/null; then
  python3 -m sparrow.entrypoints.cli --log-level INFO bench throughput --preset gpu \
  --engine-args '{"attention_backend": "flashinfer"}' --profile --result-file "$out/gpu_bench_flashinfer.json" \
  > "$out/gpu_bench_flashinfer.log" 2>&1
  echo "flashinfer bench exit code $?"; grep -v "Loading weights" "$out/gpu_bench_flashinfer.log" | tail -12
else echo "flashinfer: not installed, stage skipped"; fi; }
