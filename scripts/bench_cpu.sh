#!/usr/bin/env bash
# The CPU benchmarks of docs/benchmarks.md, side by side on one machine (run it on a quiet one).
# Usage: scripts/bench_cpu.sh [OUTDIR]   (expects the .venv from `make setup`)
set -euo pipefail
out=${1:-bench-results}
mkdir -p "$out"
. .venv/bin/activate
# 1. Offline: engine (multiprocess client, the default) against HF transformers.
sparrow bench throughput --compare-hf --repeats 3 --result-file "$out/throughput_mp.json"
# 2. The same with the engine core in-process (InprocClient).
SPARROW_ENABLE_MULTIPROCESSING=0 sparrow bench throughput --repeats 3 --result-file "$out/throughput_inproc.json"
# 3. Serving at saturation (all 64 requests at once), same workload shape.
port=18777
sparrow serve --port $port --disable-access-log > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
sparrow bench serve --base-url "http://127.0.0.1:$port" --num-prompts 64 --request-rate inf \
  --result-file "$out/serve_saturated.json"
sparrow bench serve --base-url "http://127.0.0.1:$port" --num-prompts 48 --request-rate 2 --max-seconds 120 \
  --result-file "$out/serve_rate2.json"
