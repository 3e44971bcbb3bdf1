"""The simulated device (``device="sim"``): the real engine core, scheduler and KV cache manager
over a roofline cost model, driven on simulated time. Nothing here asserts a wall-clock duration:
every time checked is simulated, hence exact for a seed."""

from __future__ import annotations

import json

import pytest

from sparrow.config import ConfigError
from sparrow.entrypoints.cli import main
from sparrow.sim import SimRequest, simulate
from sparrow.sim.bench import qwen3_0_6b_config_dir
from sparrow.sim.cost import CostModel, ModelShape
from sparrow.sim.gpus import GPUS
from sparrow.sim.platform import sim_settings


@pytest.fixture(scope="module")
def qwen06_dir(tmp_path_factory) -> str:
    """Qwen3-0.6B's shapes in a directory holding only config.json: no weights, no tokenizer."""
    return str(qwen3_0_6b_config_dir(tmp_path_factory.mktemp("qwen3-0.6b-config")))


def requests_of(num: int, prompt_len: int, max_tokens: int, arrival_gap_s: float = 0.0) -> list[SimRequest]:
    return [SimRequest([(7 * i + j) % 3000 + 1 for j in range(prompt_len)], max_tokens, arrival_s=i * arrival_gap_s)
            for i in range(num)]


def test_the_platform_is_registered_but_never_chosen_by_auto():
    from sparrow.platforms import available_platforms, resolve_platform

    assert available_platforms()["sim"] == "sparrow.sim.platform:SimPlatform"
    assert resolve_platform("auto").name != "sim"
    assert resolve_platform("sim").name == "sim"


def test_platform_and_worker_satisfy_the_kernel_protocols(qwen06_dir):
    from sparrow import interfaces
    from sparrow.sim.driver import sim_engine_config
    from sparrow.sim.platform import SimPlatform
    from sparrow.sim.worker import SimWorker

    platform = SimPlatform()
    worker = SimWorker(config=sim_engine_config(qwen06_dir), platform=platform, rank=0, local_rank=0, world_size=1,
                       distributed_init_method=None)
    assert isinstance(platform, interfaces.Platform) and isinstance(worker, interfaces.Worker)


def test_the_real_scheduler_preempts_when_the_simulated_cache_is_small(qwen06_dir):
    requests = requests_of(8, prompt_len=100, max_tokens=60)
    # 8 requests of 160 tokens need 80 blocks of 16 at the end; 24 blocks hold three of them.
    small = simulate(qwen06_dir, requests, num_kv_blocks=24, enable_prefix_caching=False)
    roomy = simulate(qwen06_dir, requests, num_kv_blocks=200, enable_prefix_caching=False)
    assert small.num_kv_blocks == 24 and roomy.num_kv_blocks == 200
    assert small.num_preemptions > 0 and roomy.num_preemptions == 0
    for result in (small, roomy):  # every request finished with exactly its tokens
        assert [r.num_output_tokens for r in result.requests] == [60] * 8
        assert all(r.arrival_s <= r.first_token_s <= r.finish_s <= result.elapsed_s for r in result.requests)
    # Preemption recomputes and serialises: the small cache takes more steps and longer.
    assert small.num_steps > roomy.num_steps and small.elapsed_s > roomy.elapsed_s


def test_the_kv_cache_is_sized_from_the_simulated_cards_memory(qwen06_dir):
    from sparrow.engine.core import EngineCore
    from sparrow.sim.driver import sim_engine_config

    def blocks(**engine_args) -> int:
        core = EngineCore(sim_engine_config(qwen06_dir, **engine_args))
        try:
            return core.num_kv_blocks
        finally:
            core.shutdown()

    # The calibration run's settings on the H100 give the measured run's cache: 38,825 blocks of 16.
    assert blocks(sim_gpu="h100", max_num_seqs=256, max_num_batched_tokens=16384) == 38825
    assert blocks(sim_gpu="h200", max_num_seqs=256, max_num_batched_tokens=16384) > 38825
    assert blocks(sim_gpu="l40s", max_num_seqs=256, max_num_batched_tokens=16384) < 38825
    assert blocks(sim_gpu="h100", gpu_memory_utilization=0.5) < blocks(sim_gpu="h100", gpu_memory_utilization=0.9)


def test_same_seed_gives_identical_results_and_arrivals_are_honoured(qwen06_dir):
    requests = requests_of(12, prompt_len=300, max_tokens=40, arrival_gap_s=0.05)
    first = simulate(qwen06_dir, requests, seed=3, max_num_seqs=4)
    second = simulate(qwen06_dir, requests, seed=3, max_num_seqs=4)
    assert first.summary() == second.summary()
    assert first.requests == second.requests
    for request, timing in zip(requests, first.requests):
        assert timing.arrival_s == request.arrival_s <= timing.first_token_s
    assert first.elapsed_s > requests[-1].arrival_s


def test_step_time_grows_with_the_kv_cache_read():
    from types import SimpleNamespace

    from sparrow.bench.gpu import QWEN3_0_6B, QWEN3_0_6B_VOCAB

    shape = ModelShape.from_hf_config(SimpleNamespace(**QWEN3_0_6B, vocab_size=QWEN3_0_6B_VOCAB))
    assert abs(shape.num_params - 596e6) < 1e6  # docs/benchmarks.md: 596 M parameters
    assert shape.kv_bytes_per_token(2) == 112 * 1024  # 112 KiB of KV per token
    cost = CostModel(shape, GPUS["h100"], dtype_bytes=2)
    short = cost.step([(100, 1)] * 64, num_sampled=64)
    long = cost.step([(4000, 1)] * 64, num_sampled=64)
    assert long.bytes_read - short.bytes_read == 64 * 3900 * cost.kv_bytes_per_token
    assert long.duration_s > short.duration_s and long.memory_s > short.memory_s
    assert long.host_s == short.host_s
    # A faster memory makes the same decode step shorter.
    assert CostModel(shape, GPUS["h200"], dtype_bytes=2).step([(4000, 1)] * 64, 64).duration_s < long.duration_s


def test_longer_contexts_give_slower_decoding_end_to_end(qwen06_dir):
    short = simulate(qwen06_dir, requests_of(16, prompt_len=64, max_tokens=32)).summary()
    long = simulate(qwen06_dir, requests_of(16, prompt_len=4000, max_tokens=32)).summary()
    assert long["mean_tpot_s"] > short["mean_tpot_s"]
    assert long["mean_ttft_s"] > short["mean_ttft_s"]


def test_bad_sim_settings_are_refused_by_name(qwen06_dir):
    with pytest.raises(ConfigError, match=r"'sim_gpu'.*'h1000'.*h100, h200, a100, l40s"):
        simulate(qwen06_dir, requests_of(1, 8, 2), sim_gpu="h1000")
    with pytest.raises(ConfigError, match="sim_tokens"):
        sim_settings({"sim_tokens": "echo"})
    with pytest.raises(ConfigError, match="sim_step_overhead_s"):
        sim_settings({"sim_step_overhead_s": -1})
    with pytest.raises(ConfigError, match="sim_gpus"):
        sim_settings({"sim_gpus": "h100"})
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        simulate(qwen06_dir, requests_of(1, 8, 2), tensor_parallel_size=2, distributed_executor_backend="mp")


def test_llm_on_the_sim_device_runs_the_ordinary_frontend(qwen3_dir):
    from sparrow import LLM, SamplingParams

    with pytest.raises(ConfigError, match="sim_gpu"):
        LLM(model=qwen3_dir, device="sim", additional_config={"sim_gpu": "tpu"}, multiprocess=False)
    llm = LLM(model=qwen3_dir, device="sim", additional_config={"sim_gpu": "a100", "sim_tokens": "copy"},
              multiprocess=False, max_model_len=128, num_kv_blocks=32)
    try:
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)
        # "copy": output k is prompt[k % len(prompt)], whatever the batch
        assert [o.outputs[0].token_ids for o in outputs] == [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12, 13, 9, 10]]
        stats = llm.collective_rpc("sim_stats")[0]
        assert stats["num_steps"] >= 7 and stats["clock_s"] > 0
    finally:
        llm.shutdown()


def test_copied_tokens_let_a_follow_up_turn_hit_the_prefix_cache(qwen06_dir):
    """A conversation's next turn carries the previous answer: with copied tokens the simulator
    knows that answer, so the whole previous turn is a prefix-cache hit."""
    first = list(range(1, 65))
    answer = [first[k % len(first)] for k in range(32)]
    turns = [SimRequest(first, 32), SimRequest(first + answer + list(range(100, 132)), 8, arrival_s=5.0)]
    copied = simulate(qwen06_dir, turns, additional_config={"sim_tokens": "copy"})
    # The first turn's 96 tokens minus its last answer token, never fed back: five full blocks of 16.
    assert copied.requests[1].num_cached_tokens == 80
    # Random tokens are not the answer the next turn carries: only the first prompt's blocks hit.
    drawn = simulate(qwen06_dir, turns)
    assert drawn.requests[1].num_cached_tokens == 64


def test_ablate_on_the_sim_device_with_a_trace_is_deterministic(qwen06_dir, tmp_path):
    from sparrow.bench.trace import save_trace, synthesize

    trace = tmp_path / "trace.jsonl"
    save_trace(trace, synthesize("shared-system-prompt", 24, seed=2, request_rate=50.0))

    def ablate(out: str) -> dict:
        assert main(["bench", "ablate", qwen06_dir, "--device", "sim", "--sim-gpu", "h200", "--trace", str(trace),
                     "--prefix-caching", "on,off", "--schedulers", "fcfs,sjf",
                     "--output-dir", str(tmp_path / out)]) == 0
        return json.loads((tmp_path / out / "results.json").read_text())

    report = ablate("a")
    assert report["sim_gpu"] == "h200" and report["num_prompts"] == 24 and report["workload"] == "trace"
    points = {p["label"]: p for p in report["points"]}
    assert set(points) == {"fcfs pc=on", "fcfs pc=off", "sjf pc=on", "sjf pc=off"}
    assert points["fcfs pc=on"]["prefix_cache_hit_rate"] > 0.5
    assert points["fcfs pc=off"]["prefix_cache_hit_rate"] == 0
    for point in points.values():
        assert point["output_tokens"] == sum(json.loads(line)["output_len"] for line in trace.read_text().splitlines())
        assert 0 < point["mean_ttft_s"] <= point["p99_ttft_s"] and point["mean_tpot_s"] > 0
    ablate("b")
    assert (tmp_path / "a" / "results.md").read_text() == (tmp_path / "b" / "results.md").read_text()
    assert (tmp_path / "a" / "results.png").read_bytes().startswith(b"\x89PNG")


def test_ablate_refuses_a_bad_sim_gpu_and_a_stray_one(qwen06_dir, tmp_path, capsys):
    assert main(["bench", "ablate", qwen06_dir, "--device", "sim", "--sim-gpu", "v100",
                 "--output-dir", str(tmp_path)]) != 0
    assert "'sim_gpu'" in capsys.readouterr().err
    assert main(["bench", "ablate", qwen06_dir, "--sim-gpu", "h100", "--output-dir", str(tmp_path)]) != 0
    assert "--sim-gpu needs --device sim" in capsys.readouterr().err
    assert not (tmp_path / "results.md").exists()


def test_calibration_command_at_a_small_size(tmp_path, capsys):
    result_file = tmp_path / "sim.json"
    assert main(["bench", "sim", "--num-prompts", "8", "--input-len-max", "300", "--output-len-max", "200",
                 "--measured-elapsed", "1.5", "--result-file", str(result_file)]) == 0
    report = json.loads(result_file.read_text())
    summary = report["summary"]
    assert report["sim_gpu"] == "h100" and report["num_prompts"] == 8
    assert summary["elapsed_s"] > 0 and summary["num_kv_blocks"] == 38825
    assert report["error"] == pytest.approx((summary["elapsed_s"] - 1.5) / 1.5)
    assert sum(bucket["steps"] for bucket in report["step_buckets"].values()) == summary["num_steps"]
    out = capsys.readouterr().out
    assert "predicted elapsed (s)" in out and "error" in out
