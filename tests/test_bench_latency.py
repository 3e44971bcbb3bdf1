"""`sparrow bench latency` as a user runs it (a subprocess, the real CLI, a local tiny model): vLLM's
flags and report, every iteration generating what it asked for, and flags refused by name."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest


def bench(*flags: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "bench", "latency", *flags],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("beam", [False, True])
def test_latency_report_as_vllm_prints_it(qwen3_dir, tmp_path, beam):
    report = tmp_path / "latency.json"
    flags = ["--batch-size", "3", "--input-len", "12", "--output-len", "5", "--n", "2", "--num-iters-warmup", "1",
             "--num-iters", "4", "--output-json", str(report), "--engine-args", '{"max_num_seqs": 8}']
    result = bench(qwen3_dir, *flags, *(["--use-beam-search"] if beam else []))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert len(data["latencies"]) == 4 and all(value > 0 for value in data["latencies"])
    assert data["avg_latency"] == pytest.approx(statistics.fmean(data["latencies"]))
    assert list(data["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    values = list(data["percentiles"].values())
    assert values == sorted(values) and min(data["latencies"]) <= values[0] <= values[-1] <= max(data["latencies"])
    assert data["percentiles"]["50"] == pytest.approx(statistics.median(data["latencies"]))
    # Every iteration generated what it asked for: 3 prompts x 2 (samples or beams) x 5 tokens, no EOS stop.
    assert data["output_tokens_per_iter"] == [3 * 2 * 5] * 4
    assert data["use_beam_search"] is beam and data["engine_args"] == {"max_num_seqs": 8}
    lines = result.stdout.splitlines()
    assert f"Avg latency: {data['avg_latency']} seconds" in lines
    for key, value in data["percentiles"].items():
        assert f"{key}% percentile latency: {value} seconds" in lines
    assert "Profiling iterations" in result.stderr  # tqdm bars on stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--n", "0"], "--n must be at least 1, got 0"),
    (["--num-iters-warmup", "-1"], "--num-iters-warmup must be at least 0, got -1"),
    (["--engine-args", "[1]"], "--engine-args must be a JSON object"),
    (["--engine-args", '{"seed": 1}'], "--engine-args sets seed; use --seed"),
])
def test_bad_flags_are_refused_before_anything_loads(flags, message):
    result = bench("/nonexistent-model", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
