"""`sparrow bench ablate`: workloads, the grid, and a tiny real run that writes every report."""

from __future__ import annotations

import json
import math

import pytest

from sparrow.bench.ablate import grid_points, make_workload, point_label
from sparrow.entrypoints.cli import main


def test_shared_prefix_workload_shares_exactly_its_prefix():
    items = make_workload("shared-prefix", 16, vocab_size=4096, seed=1)
    prefix = items[0].prompt_token_ids[:256]
    for item in items:
        assert item.prompt_token_ids[:256] == prefix
        assert 32 <= len(item.prompt_token_ids) - 256 <= 128
        assert 16 <= item.max_tokens < 64
        assert item.priority in (0, 1, 2)
    # the unique suffixes really differ
    assert len({tuple(item.prompt_token_ids[256:]) for item in items}) == len(items)


def test_offline_and_mixed_workloads_have_their_shapes():
    offline = make_workload("offline", 64, vocab_size=4096)
    assert all(16 <= len(i.prompt_token_ids) < 400 and 16 <= i.max_tokens < 200 for i in offline)
    mixed = make_workload("mixed", 200, vocab_size=4096)
    long = [i for i in mixed if len(i.prompt_token_ids) >= 256]
    short = [i for i in mixed if len(i.prompt_token_ids) < 64]
    assert len(long) + len(short) == len(mixed)
    assert 0.1 < len(long) / len(mixed) < 0.3
    assert all(i.max_tokens >= 128 for i in long) and all(i.max_tokens < 32 for i in short)
    assert make_workload("mixed", 8, 4096, seed=3) == make_workload("mixed", 8, 4096, seed=3)


def test_workload_arguments_are_validated():
    with pytest.raises(ValueError, match="workload must be one of"):
        make_workload("bursty", 4, 4096)
    with pytest.raises(ValueError, match="length_scale"):
        make_workload("offline", 4, 4096, length_scale=0)


def test_grid_is_the_product_of_the_axes_set():
    axes = {"scheduler": ["fcfs", "sjf"], "enable_prefix_caching": [True, False], "block_size": None,
            "max_num_batched_tokens": [512]}
    points = grid_points(axes)
    assert len(points) == 4
    assert {"scheduler": "sjf", "enable_prefix_caching": False, "max_num_batched_tokens": 512} in points
    assert all("block_size" not in p for p in points)
    varying = {"scheduler", "enable_prefix_caching"}
    assert point_label(points[-1], varying) == "sjf pc=off"
    assert grid_points({"scheduler": None}) == [{}]


def test_bad_grid_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "ablate", "--prefix-caching", "maybe"])
    assert "--prefix-caching" in capsys.readouterr().err


# A mistake anywhere in the grid, and the words its one line must contain. (The last value of a
# list fails as well as the first: every value is checked before any point runs.)
GRID_MISTAKES = {
    "scheduler": (["--schedulers", "fcfs,sjf,nope"], ["--schedulers nope", "unknown scheduler"]),
    "eviction-policy": (["--kv-eviction-policies", "lru,nope"], ["--kv-eviction-policies nope", "registered"]),
    "device": (["--device", "nosuch"], ["--device nosuch", "unknown device"]),
    "device-in-engine-args": (["--engine-args", '{"device": "nosuch"}'], ["--engine-args device nosuch"]),
    "sim-gpu": (["--device", "sim", "--sim-gpu", "nope", "--schedulers", "fcfs,sjf"], ["--sim-gpu nope"]),
    "sim-scheduler": (["--device", "sim", "--schedulers", "fcfs,nope"], ["--schedulers nope"]),
    "engine-args": (["--engine-args", '{"max_model_len": 100000}'], ["--engine-args", "max_model_len"]),
    "engine-args-json": (["--engine-args", "{bad"], ["--engine-args", "JSON"]),
    "engine-args-seed": (["--engine-args", '{"seed": 3}'], ["--engine-args", "--seed"]),
    "budget": (["--max-num-batched-tokens", "2048,64", "--engine-args",
                '{"max_model_len": 256, "enable_chunked_prefill": false}'], ["--max-num-batched-tokens 64"]),
    "trace": (["--trace", "no-such-trace.jsonl"], ["--trace", "no such file"]),
    "length-scale": (["--length-scale", "0"], ["--length-scale"]),
    "all-and-names": (["--schedulers", "all,fcfs"], ["--schedulers", "all"]),
}


@pytest.mark.parametrize("mistake", sorted(GRID_MISTAKES))
def test_every_grid_value_is_checked_before_the_first_point(mistake, qwen3_dir, tmp_path, monkeypatch, capsys):
    from sparrow.bench import ablate

    def no_run(*args, **kwargs):
        raise AssertionError("a grid point ran before every value was checked")

    monkeypatch.setattr(ablate, "run_point", no_run)
    monkeypatch.setattr(ablate, "run_sim_point", no_run)
    monkeypatch.chdir(tmp_path)
    flags, words = GRID_MISTAKES[mistake]
    assert main(["bench", "ablate", qwen3_dir, "--num-prompts", "2", "--output-dir", "out", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparrow: error: "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "out").exists()


def test_a_combination_is_checked_after_each_value_alone():
    from sparrow.bench.ablate_checks import check_grid
    from sparrow.config import ConfigError

    def check(point):  # the engine's pre-flight, standing in: sjf with 32-token blocks is refused
        if point.get("scheduler") == "sjf" and point.get("block_size") == 32:
            raise ConfigError("sjf cannot use 32-token blocks")

    axes = {"scheduler": ["fcfs", "sjf"], "block_size": [16, 32]}
    flags = {"scheduler": "--schedulers", "block_size": "--block-size"}
    label = lambda point: point_label(point, set(point))  # noqa: E731
    with pytest.raises(ValueError, match=r"^grid point 'sjf bs=32': sjf cannot"):
        check_grid(axes, flags, grid_points(axes), check, label)
    check_grid(axes, flags, grid_points({"scheduler": ["fcfs", "sjf"], "block_size": [16]}), check, label)


def test_tiny_grid_writes_table_json_and_chart(qwen3_dir, tmp_path):
    out_dir = tmp_path / "ablate"
    engine_args = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}
    main(["bench", "ablate", qwen3_dir, "--workload", "shared-prefix", "--num-prompts", "4",
          "--length-scale", "0.1", "--prefix-caching", "on,off", "--no-multiprocess",
          "--engine-args", json.dumps(engine_args), "--output-dir", str(out_dir)])

    report = json.loads((out_dir / "results.json").read_text())
    assert report["workload"] == "shared-prefix" and report["num_prompts"] == 4
    assert report["axes"] == {"scheduler": ["fcfs"], "enable_prefix_caching": [True, False]}
    assert [p["label"] for p in report["points"]] == ["pc=on", "pc=off"]
    for point in report["points"]:
        for key in ("request_throughput", "output_tok_s", "total_tok_s", "mean_e2e_s", "p99_e2e_s", "elapsed_s"):
            assert math.isfinite(point[key]) and point[key] > 0, key
        assert point["mean_e2e_s"] <= point["p99_e2e_s"] <= point["elapsed_s"] + 1e-6
        assert point["output_tokens"] > 0 and point["prompt_tokens"] > 0
    caching_on, caching_off = report["points"]
    # 4 requests share a 26-token prefix (one full 16-token block): the later ones hit it.
    assert 0 < caching_on["prefix_cache_hit_rate"] <= 1
    assert caching_on["prefix_cache_hits"] == caching_on["cached_prompt_tokens"] > 0
    assert caching_off["prefix_cache_hit_rate"] == 0 and caching_off["cached_prompt_tokens"] == 0

    table = (out_dir / "results.md").read_text().splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| point |"))
    rows = table[header + 2:]
    assert [row.split("|")[1].strip() for row in rows] == ["pc=on", "pc=off"]
    assert all(row.count("|") == table[header].count("|") for row in rows)

    png = (out_dir / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    assert matplotlib.image.imread(str(out_dir / "results.png")).ndim == 3


def test_real_engine_replays_a_trace_at_its_arrival_times(qwen3_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"arrival_s": 0.0, "prompt_len": 12, "output_len": 4},
             {"arrival_s": 0.0, "prompt_len": 20, "output_len": 3, "prefix_group": "sys", "prefix_len": 16},
             {"arrival_s": 0.4, "prompt_len": 24, "output_len": 5, "prefix_group": "sys", "prefix_len": 16}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out_dir = tmp_path / "ablate"
    engine_args = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 32}
    assert main(["bench", "ablate", qwen3_dir, "--trace", str(trace), "--no-multiprocess",
                 "--engine-args", json.dumps(engine_args), "--output-dir", str(out_dir)]) == 0
    report = json.loads((out_dir / "results.json").read_text())
    assert report["workload"] == "trace" and report["trace"] == str(trace) and report["num_prompts"] == 3
    point, = report["points"]
    assert point["output_tokens"] == 12 and point["prompt_tokens"] == 56
    # The last request was submitted at 0.4 s, not at t0: the run cannot end before it arrived.
    assert point["elapsed_s"] >= 0.4
    assert 0 < point["mean_ttft_s"] <= point["p99_ttft_s"] <= point["p99_e2e_s"]
    # It shares its group's 16-token prefix with the second request: one full block hits.
    assert point["prefix_cache_hits"] >= 16
    assert "trace" in (out_dir / "results.md").read_text().splitlines()[0]


def test_a_point_that_fails_when_it_runs_is_a_row_and_the_grid_goes_on(tmp_path, monkeypatch, capsys):
    # Every value passes the checks made before the first point; the second point then fails at
    # run time (as an out-of-memory or a plugin's bug would). The first and third are measured,
    # the second is a row saying why, and results.json was rewritten after every point.
    from sparrow.bench import ablate

    out_dir = tmp_path / "ablate"
    real_run_sim_point = ablate.run_sim_point
    written_after_each_point = []

    def run_sim_point(model_path, workload, point, *args):
        if (out_dir / "results.json").exists():
            written_after_each_point.append(len(json.loads((out_dir / "results.json").read_text())["points"]))
        if point["scheduler"] == "sjf":
            raise MemoryError("simulated: out of memory at step 12")
        return real_run_sim_point(model_path, workload, point, *args)

    monkeypatch.setattr(ablate, "run_sim_point", run_sim_point)
    status = main(["bench", "ablate", "--device", "sim", "--schedulers", "fcfs,sjf,lpm", "--num-prompts", "8",
                   "--length-scale", "0.2", "--output-dir", str(out_dir)])
    assert status == 1
    error = capsys.readouterr().err
    assert "sparrow: error: 1 of 3 grid points failed (sjf)" in error, error
    assert written_after_each_point == [1, 2]
    report = json.loads((out_dir / "results.json").read_text())
    fcfs, sjf, lpm = report["points"]
    assert sjf["error"] == "MemoryError: simulated: out of memory at step 12"
    assert fcfs["output_tok_s"] > 0 and lpm["output_tok_s"] > 0
    table = (out_dir / "results.md").read_text()
    assert "| sjf | failed: MemoryError: simulated: out of memory at step 12 |" in table
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| point |"))
    assert all(line.count("|") == lines[header].count("|") for line in lines[header + 2:header + 5])
    assert (out_dir / "results.png").exists()
