"""A platform shapes the engine configuration; plugins bring communicators, loaders and quantization.

The vendor plugin below (``VENDOR_PLUGIN``) is what an out-of-tree platform package would ship: a
platform reusing the CPU platform's classes whose ``check_and_update_config`` reads its settings
from ``additional_config``, a device communicator counting the collectives it serves, a model
loader and a quantization method. Tests that keep the engine in this process register it here;
tests whose engine spans processes (tensor-parallel ranks, ``sparrow serve``) expose it as an entry
point (a dist-info directory on PYTHONPATH), found by every process the child starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from sparrow.config import ConfigError, EngineConfig
from sparrow.distributed import TorchDistributedCommunicator
from sparrow.hookspecs import hookimpl
from sparrow.model_loader import SafetensorsLoader
from sparrow.ops.base import OpImpl
from sparrow.plugins import get_plugin_manager, register_plugin
from sparrow.quantization import QuantizationMethod
from sparrow_cpu.platform import CpuPlatform
from sparrow_cpu.worker import CpuWorker

ROOT = Path(__file__).resolve().parents[1]
VENDOR = "vendor_test"
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)
PROMPTS = [[(11 * n + 5 * i) % 3000 + 1 for i in range(n)] for n in (4, 30)]
MAX_TOKENS = 5


# -- the vendor plugin --------------------------------------------------------------------------
class VendorPlatform(CpuPlatform):
    """The CPU platform's kernels and worker under another name, configured by additional_config."""

    name = VENDOR
    worker_cls = "tests.test_platform_config:VendorWorker"
    communicator = "counting"

    def check_and_update_config(self, config: EngineConfig) -> None:
        settings = config.additional_config.get(VENDOR, {})
        if settings.get("refuse_dtype") == config.model.dtype:
            raise ConfigError(f"invalid engine argument 'dtype': {VENDOR} cannot run {config.model.dtype}")
        if "block_size" in settings:
            config.cache.block_size = settings["block_size"]
        if "scheduler" in settings:
            config.scheduler.scheduler = settings["scheduler"]
        if "device" in settings:
            config.device.device = settings["device"]
        if "record" in settings:
            Path(settings["record"]).write_text(json.dumps(
                {"pid": os.getpid(), "additional_config": config.additional_config}))


class VendorWorker(CpuWorker):
    def init_device(self) -> None:
        super().init_device()
        record = self.config.additional_config.get(VENDOR, {}).get("worker_record")
        if record:  # what the engine's own processes received
            Path(f"{record}.rank{self.rank}").write_text(json.dumps(
                {"pid": os.getpid(), "additional_config": self.config.additional_config,
                 "block_size": self.block_size, "scheduler": self.config.scheduler.scheduler}))

    def communicator_calls(self) -> dict[str, int]:
        return dict(self.tp.communicator.calls) if self.tp is not None else {}


class CountingCommunicator(TorchDistributedCommunicator):
    name = "counting"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter = Counter()

    def all_reduce(self, tensor):
        self.calls["all_reduce"] += 1
        return super().all_reduce(tensor)

    def all_gather(self, tensor, dim=-1):
        self.calls["all_gather"] += 1
        return super().all_gather(tensor, dim)

    def broadcast_from_first(self, tensor):
        self.calls["broadcast_from_first"] += 1
        return super().broadcast_from_first(tensor)


class RecordingLoader(SafetensorsLoader):
    name = "recording"
    loaded: list[str] = []  # model directories, in this process

    def load_weights(self, model, model_dir, tp) -> None:
        super().load_weights(model, model_dir, tp)
        RecordingLoader.loaded.append(str(model_dir))


class RoundingLinear(OpImpl):
    """Weights rounded to 3 bits per row (symmetric, absmax scale): a quantization whose effect on
    the logits is plain to see, computed by the layer's own reference on the rounded weights."""

    name = "rounding_linear"
    calls = 0
    LEVELS = 3

    def process_weights(self) -> None:
        weight = self.layer.weight.data
        scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / self.LEVELS
        self.layer.replace_parameter("weight", (weight / scale).round().clamp(-self.LEVELS, self.LEVELS) * scale)

    def __call__(self, *args, **kwargs):
        RoundingLinear.calls += 1
        return self.layer.forward_native(*args, **kwargs)


class RoundingMethod(QuantizationMethod):
    name = "round_test"

    def check_config(self, config: EngineConfig) -> None:
        if config.model.dtype != "float32":
            raise ConfigError(f"invalid engine argument 'dtype': quantization {self.name!r} needs float32, "
                              f"got {config.model.dtype!r}")

    def op_overrides(self, platform: str) -> dict[str, type[OpImpl]]:
        return {"linear": RoundingLinear}


class VendorPlugin:
    @hookimpl
    def sparrow_register_platforms(self, register) -> None:
        register(VENDOR, lambda: "tests.test_platform_config:VendorPlatform", priority=-100)

    @hookimpl
    def sparrow_attention_backend(self, platform, requested):
        if platform.name != VENDOR:
            return None
        from sparrow_cpu.attention import TorchPagedAttention

        return TorchPagedAttention

    @hookimpl
    def sparrow_execute_model(self, worker, scheduler_output):
        if worker.platform.name != VENDOR:
            return None
        return worker.execute_model(scheduler_output)

    @hookimpl
    def sparrow_register_device_communicators(self, register) -> None:
        register("counting", CountingCommunicator)

    @hookimpl
    def sparrow_register_model_loaders(self, register) -> None:
        register("recording", RecordingLoader)

    @hookimpl
    def sparrow_register_quantization_methods(self, register) -> None:
        register("round_test", "tests.test_platform_config:RoundingMethod")


VENDOR_PLUGIN = VendorPlugin()


@pytest.fixture
def vendor():
    """The vendor plugin registered in this process's plugin manager for one test."""
    pm = get_plugin_manager()
    register_plugin(pm, VENDOR_PLUGIN, VENDOR)
    try:
        yield pm
    finally:
        pm.unregister(name=VENDOR)


@pytest.fixture(scope="module")
def vendor_env(tmp_path_factory) -> dict[str, str]:
    """An environment in which every Python process finds the vendor plugin as an entry point."""
    root = tmp_path_factory.mktemp("vendor-plugin")
    dist = root / "sparrow_vendor_test-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sparrow-vendor-test\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[sparrow]\n{VENDOR} = tests.test_platform_config:VENDOR_PLUGIN\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SPARROW_PLUGINS", "SPARROW_TRACE_FILE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def generate(llm, logprobs: int | None = None):
    from sparrow import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@contextlib.contextmanager
def llm_here(model_dir: str, **kwargs):
    from sparrow import LLM

    llm = LLM(model_dir, multiprocess=False, **{**ENGINE_ARGS, **kwargs})
    try:
        yield llm
    finally:
        llm.shutdown()


def finalized(**kwargs) -> EngineConfig:
    from sparrow.engine.setup import finalize_config

    return finalize_config(EngineConfig.from_kwargs(**{**ENGINE_ARGS, **kwargs}))


# -- check_and_update_config and additional_config -----------------------------------------------
def test_platform_hook_sets_block_size_and_scheduler_from_additional_config(vendor, qwen3_dir, tmp_path):
    record = tmp_path / "frontend.json"
    settings = {VENDOR: {"block_size": 32, "scheduler": "sjf", "record": str(record)}}
    with llm_here(qwen3_dir, device=VENDOR, additional_config=settings) as llm:
        outputs = generate(llm)
        engine = llm.llm_engine
        assert engine.engine_core.call_utility("get_kv_cache_info")["block_size"] == 32
        assert type(engine.engine_core.engine_core.scheduler).__name__ == "ShortestJobFirstScheduler"
        assert (engine.config.cache.block_size, engine.config.scheduler.scheduler) == (32, "sjf")
    assert [len(t) for t in tokens_of(outputs)] == [MAX_TOKENS] * len(PROMPTS)
    assert json.loads(record.read_text()) == {"pid": os.getpid(), "additional_config": settings}

    # Without settings the platform changes nothing: its default block size, the default policy.
    config = finalized(model=qwen3_dir, device=VENDOR)
    assert (config.cache.block_size, config.scheduler.scheduler, config.additional_config) == (None, "fcfs", {})
    # The caller's config is never changed by the hook; an "auto" device is pinned to the resolved platform.
    mine = EngineConfig.from_kwargs(model=qwen3_dir, device=VENDOR, additional_config={VENDOR: {"block_size": 8}})
    from sparrow.engine.setup import finalize_config

    assert finalize_config(mine).cache.block_size == 8 and mine.cache.block_size is None
    assert finalized(model=qwen3_dir).device.device == "cpu"


def test_platform_hook_refusals_and_invalid_values_are_config_errors(vendor, qwen3_dir):
    cases = [
        ({"block_size": 0}, r"platform 'vendor_test' set an invalid value: .*'block_size'"),
        ({"scheduler": "nope"}, r"'scheduler': unknown scheduler 'nope'"),
        ({"refuse_dtype": "float32"}, r"'dtype': vendor_test cannot run float32"),
        ({"device": "cpu"}, r"'device': platform 'vendor_test' changed it to 'cpu'"),
    ]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=message):
            finalized(model=qwen3_dir, device=VENDOR, additional_config={VENDOR: settings})
    with pytest.raises(ConfigError, match=r"'additional_config'.*JSON-serialisable"):
        EngineConfig.from_kwargs(additional_config={"k": object()})
    with pytest.raises(ConfigError, match=r"'additional_config'"):
        EngineConfig.from_kwargs(additional_config=["not", "a", "dict"])


def test_additional_config_flag_parses_json(capsys):
    from sparrow.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "/m", "--additional-config", '{"k": 1, "n": {"x": [1, 2]}}'])
    assert engine_kwargs(args)["additional_config"] == {"k": 1, "n": {"x": [1, 2]}}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "/m", "--additional-config", "[1]"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_additional_config_reaches_the_platform_and_the_engine_from_sparrow_serve(vendor_env, qwen3_dir, tmp_path):
    import httpx
    import openai

    from tests.test_server import free_port

    frontend, worker = tmp_path / "frontend.json", tmp_path / "worker.json"
    settings = {VENDOR: {"block_size": 32, "scheduler": "sjf", "record": str(frontend), "worker_record": str(worker)},
                "other_plugin": {"level": 3}}
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "sparrow.entrypoints.cli", "serve", qwen3_dir, "--port", str(port),
               "--device", VENDOR, "--additional-config", json.dumps(settings), "--served-model-name", "m",
               "--max-model-len", "256", "--num-kv-blocks", "64"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=vendor_env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"server exited:\n{log_path.read_text(errors='replace')[-4000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"server not healthy:\n{log_path.read_text(errors='replace')[-4000:]}"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        completion = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0.0)
        assert completion.usage.completion_tokens == 3
    finally:
        proc.kill()
        proc.wait(30)
    seen_by_platform = json.loads(frontend.read_text())
    seen_by_worker = json.loads((tmp_path / "worker.json.rank0").read_text())
    assert seen_by_platform == {"pid": proc.pid, "additional_config": settings}
    # The engine core (its own process) got the configuration the platform changed.
    assert seen_by_worker["pid"] != proc.pid
    assert seen_by_worker == {"pid": seen_by_worker["pid"], "additional_config": settings, "block_size": 32,
                              "scheduler": "sjf"}


# -- device communicators -----------------------------------------------------------------------
TP_CHILD = textwrap.dedent("""
    import json, sys
    from sparrow import LLM, SamplingParams

    args = json.loads(sys.argv[1])
    params = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, ignore_eos=True)
    with LLM(args["model"], device="vendor_test", tensor_parallel_size=2, multiprocess=False, **args["engine"]) as llm:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in args["prompts"]], params, use_tqdm=False)
        calls = llm.collective_rpc("communicator_calls")
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outputs], "calls": calls}))
""")


def test_sparrow_register_device_communicators_serves_tensor_parallelism(vendor_env, qwen3_dir):
    args = {"model": qwen3_dir, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engine": ENGINE_ARGS}
    proc = subprocess.run([sys.executable, "-c", TP_CHILD, json.dumps(args)], env=vendor_env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    calls = result["calls"]
    assert len(calls) == 2 and calls[0] == calls[1], calls  # every rank ran the same collectives
    # Row-parallel layers reduce, the LM head gathers, rank 0's sampled tokens are broadcast.
    assert calls[0]["all_reduce"] > 0 and calls[0]["all_gather"] > 0 and calls[0]["broadcast_from_first"] > 0
    with llm_here(qwen3_dir) as llm:
        assert result["tokens"] == tokens_of(generate(llm))


def test_an_unknown_communicator_is_refused_before_start_up(vendor, qwen3_dir, monkeypatch):
    monkeypatch.setattr(VendorPlatform, "communicator", "no_such_ccl")
    with pytest.raises(ConfigError, match=r"'tensor_parallel_size'.*'no_such_ccl'.*registered: counting, "
                                          r"torch_distributed"):
        finalized(model=qwen3_dir, device=VENDOR, tensor_parallel_size=2)
    assert finalized(model=qwen3_dir, device=VENDOR).device.device == VENDOR  # one rank needs none


# -- model loaders -------------------------------------------------------------------------------
def test_dummy_load_format_generates_without_reading_a_checkpoint(qwen3_dir, tmp_path):
    import torch

    from sparrow.model_loader import load_model
    from sparrow_cpu.attention import TorchPagedAttention

    bare = tmp_path / "no_weights"
    shutil.copytree(qwen3_dir, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    with pytest.raises(ConfigError, match=r"'model': no \*\.safetensors weight files"):
        finalized(model=str(bare))
    with llm_here(str(bare), load_format="dummy") as llm:
        tokens = tokens_of(generate(llm))
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)

    def dummy_params(seed: int) -> dict[str, torch.Tensor]:
        config = EngineConfig.from_kwargs(load_format="dummy", seed=seed)
        model = load_model(bare, TorchPagedAttention, torch.float32, "cpu", config=config)
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    first, again, other = dummy_params(3), dummy_params(3), dummy_params(4)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not any(torch.equal(first[name], other[name]) for name in first)
    assert all(p.abs().max() <= 1e-3 for p in first.values())


def test_sparrow_register_model_loaders_plugin_loader_is_used(vendor, qwen3_dir):
    RecordingLoader.loaded.clear()
    with llm_here(qwen3_dir, load_format="recording") as llm:
        recorded = tokens_of(generate(llm))
    assert RecordingLoader.loaded == [qwen3_dir]
    with llm_here(qwen3_dir) as llm:
        assert recorded == tokens_of(generate(llm))
    with pytest.raises(ConfigError, match=r"'load_format': unknown load_format 'nope'; registered: auto, dummy, "
                                          r"recording, safetensors"):
        finalized(model=qwen3_dir, load_format="nope")


# -- quantization methods ------------------------------------------------------------------------
def test_sparrow_register_quantization_methods_serves_linear_layers(vendor, qwen3_dir):
    from sparrow.quantization import op_overrides_for

    config = finalized(model=qwen3_dir, quantization="round_test")
    assert op_overrides_for(config, "cpu") == {"linear": RoundingLinear}
    assert op_overrides_for(finalized(model=qwen3_dir), "cpu") == {}

    RoundingLinear.calls = 0
    with llm_here(qwen3_dir, quantization="round_test") as llm:
        quantized = generate(llm, logprobs=1)
    assert RoundingLinear.calls > 0, "the quantization method's linear implementation never ran"
    with llm_here(qwen3_dir) as llm:
        plain = generate(llm, logprobs=1)

    def first_logprob(outputs) -> list[float]:
        return [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in outputs]

    # 3-bit weights move every prompt's first logprob.
    differences = [abs(a - b) for a, b in zip(first_logprob(quantized), first_logprob(plain))]
    assert all(d > 1e-4 for d in differences), differences

    with pytest.raises(ConfigError, match=r"'dtype': quantization 'round_test' needs float32"):
        finalized(model=qwen3_dir, quantization="round_test", dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"'quantization': unknown quantization method 'nope'; registered: "
                                          r"awq, fp8, gptq, int8, round_test"):
        finalized(model=qwen3_dir, quantization="nope")
