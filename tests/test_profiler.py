"""``LLM.start_profile()`` / ``stop_profile()`` (vLLM's names), the server's ``/start_profile`` and
``/stop_profile``, and ``sparrow bench throughput --profile``: torch.profiler in every worker, a
summary per rank (sparrow.worker.profiler), and a Chrome trace per rank where
SPARROW_TORCH_PROFILER_DIR points. On the CPU there are no device kernels, so the device's busy
fraction is None; the GPU figures come from scripts/gpu_checks.sh.
"""

from __future__ import annotations

import json

import httpx
import pytest

from sparrow import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def check_summaries(summaries, ranks: int, trace_dir=None) -> None:
    assert [s["rank"] for s in summaries] == list(range(ranks))
    for summary in summaries:
        assert summary["device"] == "cpu" and summary["wall_s"] > 0
        assert summary["device_busy_s"] is None and summary["device_busy_fraction"] is None
        if trace_dir is None:
            assert summary["trace"] is None
            continue
        assert summary["trace"].startswith(str(trace_dir))
        with open(summary["trace"]) as handle:
            events = json.load(handle)["traceEvents"]
        # the model's forward ran inside the window: its matmuls are in the trace
        assert any("linear" in str(event.get("name", "")) or "mm" in str(event.get("name", "")) for event in events)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_llm_profiles_a_window_and_writes_a_trace(qwen3_dir, tmp_path, monkeypatch, multiprocess):
    monkeypatch.setenv("SPARROW_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm = LLM(qwen3_dir, multiprocess=multiprocess, max_model_len=256)
    try:
        with pytest.raises(Exception, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(Exception, match="already running"):
            llm.start_profile()
        outputs = llm.generate(["a profiled prompt"], PARAMS, use_tqdm=False)
        summaries = llm.stop_profile()
        # the engine keeps serving after the errors above
        assert len(outputs[0].outputs[0].token_ids) == 6
        assert llm.generate(["after"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    check_summaries(summaries, 1, tmp_path / "traces")


def test_every_tensor_parallel_rank_profiles(qwen3_dir, monkeypatch):
    monkeypatch.delenv("SPARROW_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(qwen3_dir, tensor_parallel_size=2, max_model_len=256)
    try:
        llm.start_profile()
        llm.generate(["two ranks"], PARAMS, use_tqdm=False)
        summaries = llm.stop_profile()
    finally:
        llm.shutdown()
    check_summaries(summaries, 2)


def test_server_profile_routes_exist_only_with_the_directory(qwen3_dir, tmp_path, monkeypatch):
    import asyncio
    import types

    from sparrow.entrypoints.openai.api_server import build_app
    from tests.test_server_lifecycle import MODEL_NAME, ServerProcess

    # Without the directory the app has no profile routes (build_app decides; its engine is a stub
    # here, the far side of a route table, so that only the profiled server below starts a model).

    monkeypatch.delenv("SPARROW_TORCH_PROFILER_DIR", raising=False)
    model_config = types.SimpleNamespace(generation_config="auto", override_generation_config={},
                                         reasoning_parser=None, max_model_len=256)
    engine = types.SimpleNamespace(
        served_model_name=MODEL_NAME, default_sampling_params={}, model_config=model_config, tokenizer=None,
        config=types.SimpleNamespace(lora=types.SimpleNamespace(enable_lora=False)),
        input_processor=types.SimpleNamespace(pooling=None, max_logprobs=20))
    app = build_app(engine)  # type: ignore[arg-type]

    async def post(path: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return (await http.post(path)).status_code

    assert asyncio.run(post("/start_profile")) == 404 and asyncio.run(post("/stop_profile")) == 404
    monkeypatch.setenv("SPARROW_TORCH_PROFILER_DIR", str(tmp_path / "server-traces"))
    server = ServerProcess(qwen3_dir, tmp_path / "profiled.log")
    try:
        assert httpx.post(server.url + "/start_profile", timeout=30).status_code == 200
        body = {"model": MODEL_NAME, "prompt": "profile me", "max_tokens": 4}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        response = httpx.post(server.url + "/stop_profile", timeout=60)
        assert response.status_code == 200, response.text
        check_summaries(response.json(), 1, tmp_path / "server-traces")
    finally:
        server.stop()


def test_bench_throughput_reports_the_profiled_run(tmp_path, monkeypatch, capsys):
    from sparrow.entrypoints.cli import main

    monkeypatch.delenv("SPARROW_TORCH_PROFILER_DIR", raising=False)
    result_file = tmp_path / "throughput.json"
    main(["bench", "throughput", "--num-prompts", "3", "--input-len-max", "40", "--output-len-max", "24",
          "--profile", "--result-file", str(result_file)])
    assert "device busy (profiled run)       n/a on cpu" in capsys.readouterr().out
    check_summaries(json.loads(result_file.read_text())["profile"], 1)
