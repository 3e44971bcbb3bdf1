"""LoRA inputs that must be refused, each naming its field: LoRARequest, the engine arguments,
PEFT adapter directories and ``--lora-modules``. No engine is started here."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest

from sparrow import ConfigError, EngineConfig, LoRARequest
from sparrow.errors import InvalidArgumentError
from sparrow.lora.engine import check_lora_config, check_lora_request, lora_requests_per_prompt
from sparrow.lora.peft import check_adapter, read_adapter_config
from sparrow.tiny.lora import build_lora_adapter


@pytest.fixture(scope="module")
def adapter_dir(qwen3_dir, tmp_path_factory) -> str:
    return str(build_lora_adapter(qwen3_dir, tmp_path_factory.mktemp("adapter") / "a", rank=4, alpha=8, seed=0))


def edited_copy(adapter_dir: str, tmp_path, **changes) -> str:
    """A copy of the adapter whose adapter_config.json has ``changes``."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(adapter_dir, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    config.update(changes)
    (copy / "adapter_config.json").write_text(json.dumps(config))
    return str(copy)


@pytest.mark.parametrize("kwargs, field", [
    (dict(lora_name="a", lora_int_id=0, lora_path="/p"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=True, lora_path="/p"), "lora_int_id"),
    (dict(lora_name="", lora_int_id=1, lora_path="/p"), "lora_name"),
])
def test_lora_request_validates_its_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoRARequest(**kwargs)
    request = LoRARequest("ok", 3, "/p")
    assert (request.adapter_id, request.name, request.path) == (3, "ok", "/p")


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_loras=0), "max_loras"),
    (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loras=3, max_cpu_loras=2), "max_cpu_loras"),
])
def test_engine_arguments_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_kwargs(enable_lora=True, **kwargs)


LLAMA_CONFIG = SimpleNamespace(architectures=["Qwen3ForCausalLM"])


def test_an_architecture_without_a_lora_path_is_refused():
    moe = SimpleNamespace(architectures=["Qwen3MoeForCausalLM"])
    problem = check_lora_config(EngineConfig.from_kwargs(enable_lora=True), moe)
    assert problem is not None and problem[0] == "enable_lora" and "Qwen3MoeForCausalLM" in problem[1]
    assert check_lora_config(EngineConfig.from_kwargs(), moe) is None  # LoRA off: no opinion


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=2),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
    dict(quantization="int8"),
    dict(tensor_parallel_size=2, quantization="int8", speculative_config={"method": "ngram",
                                                                          "num_speculative_tokens": 2}),
])
def test_lora_combines_with_tensor_parallelism_quantization_and_speculation(kwargs):
    assert check_lora_config(EngineConfig.from_kwargs(enable_lora=True, **kwargs), LLAMA_CONFIG) is None


def test_the_preflight_refuses_before_any_process_starts(tmp_path):
    from sparrow.engine.setup import finalize_config
    from tests.conftest import build_test_model

    phi3 = build_test_model(tmp_path / "phi3", arch="phi3", preset="test", seed=5)
    with pytest.raises(ConfigError, match="enable_lora.*Phi3ForCausalLM"):
        finalize_config(EngineConfig.from_kwargs(model=phi3, enable_lora=True))


def test_lora_request_needs_enable_lora(adapter_dir):
    with pytest.raises(InvalidArgumentError, match="enable_lora=True") as info:
        check_lora_request(LoRARequest("a", 1, adapter_dir), EngineConfig())
    assert info.value.field == "lora_request"
    with pytest.raises(InvalidArgumentError) as info:
        check_lora_request("a", EngineConfig.from_kwargs(enable_lora=True))
    assert info.value.field == "lora_request"


def test_lora_request_lists_match_the_prompts(adapter_dir):
    request = LoRARequest("a", 1, adapter_dir)
    assert lora_requests_per_prompt(request, 3) == [request] * 3
    assert lora_requests_per_prompt([None, request], 2) == [None, request]
    with pytest.raises(InvalidArgumentError, match="lora_request: got 1") as info:
        lora_requests_per_prompt([request], 2)
    assert info.value.field == "lora_request"


@pytest.mark.parametrize("changes, key", [
    (dict(bias="all"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "target_modules"),
    (dict(target_modules="all-linear"), "target_modules"),
    (dict(r=0), "r"),
    (dict(lora_alpha="high"), "lora_alpha"),
    (dict(use_dora=True), "use_dora"),
    (dict(peft_type="IA3"), "peft_type"),
])
def test_adapter_config_refusals_name_the_key(adapter_dir, tmp_path, changes, key):
    with pytest.raises(ValueError, match=f"adapter_config.json '{key}'"):
        read_adapter_config(edited_copy(adapter_dir, tmp_path, **changes))


def test_rank_above_max_lora_rank_and_rslora_scaling(adapter_dir, tmp_path):
    with pytest.raises(ValueError, match="'r' is 4, more than max_lora_rank=2"):
        read_adapter_config(adapter_dir, max_lora_rank=2)
    assert read_adapter_config(adapter_dir).scaling == 8 / 4
    rslora = read_adapter_config(edited_copy(adapter_dir, tmp_path, use_rslora=True))
    assert math.isclose(rslora.scaling, 8 / math.sqrt(4))


def test_adapter_directories_that_are_not_adapters(adapter_dir, tmp_path):
    with pytest.raises(ValueError, match="lora_path .* is not a directory"):
        read_adapter_config(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter_config(tmp_path / "empty")


def test_adapter_tensors_must_fit_the_model(adapter_dir, qwen3_dir, model_dirs, tmp_path):
    from sparrow.model_loader import get_hf_config

    qwen3 = get_hf_config(qwen3_dir)
    assert check_adapter(adapter_dir, max_lora_rank=8, hf_config=qwen3).rank == 4
    # The same adapter against a model with other sizes: the first misfit tensor is named.
    other = SimpleNamespace(**{**qwen3.to_dict(), "intermediate_size": qwen3.intermediate_size * 2})
    with pytest.raises(ValueError, match=r"tensor 'base_model\.model\.model\.layers\.0\.mlp\.\w+_proj\.lora_[AB]"):
        check_adapter(adapter_dir, max_lora_rank=8, hf_config=other)
    fewer_layers = SimpleNamespace(**{**qwen3.to_dict(), "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="is for layer 1, but the model has 1 layers"):
        check_adapter(adapter_dir, max_lora_rank=8, hf_config=fewer_layers)


def test_lora_modules_flag():
    from sparrow.entrypoints.cli import build_parser
    from sparrow.entrypoints.openai.serving_models import parse_lora_module

    assert parse_lora_module("sql=/adapters/sql") == {"name": "sql", "path": "/adapters/sql"}
    entry = {"name": "sql", "path": "/a", "base_model_name": "base"}
    assert parse_lora_module(json.dumps(entry)) == entry
    for bad in ("no-equals-sign", "=path", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 2}', "{oops"):
        with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules"):
            parse_lora_module(bad)
    args = build_parser().parse_args(["serve", "/m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                                      "--max-cpu-loras", "4", "--lora-modules", "a=/x", json.dumps(entry)])
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 3, 32, 4)
    assert [m["name"] for m in args.lora_modules] == ["a", "sql"]


def test_lora_off_builds_no_manager(qwen3_dir):
    from sparrow.worker.model_runner import build_lora_manager

    assert build_lora_manager(EngineConfig(), model=None, device=None, dtype=None, platform="cpu") is None


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once():
    """vLLM's rule: a waiting request whose adapter would be one too many waits (keeping its
    place); base-model requests and requests of adapters already running are admitted."""
    from sparrow.core.kv_cache_manager import KVCacheManager
    from sparrow.core.request import Request
    from sparrow.core.sched.scheduler import Scheduler
    from sparrow.sampling_params import SamplingParams

    scheduler = Scheduler(KVCacheManager(num_blocks=64, block_size=16), max_num_seqs=16,
                          max_num_batched_tokens=512, max_model_len=128)
    scheduler.max_loras = 1
    one, two = LoRARequest("one", 1, "/a"), LoRARequest("two", 2, "/b")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for req_id, lora in (("a", one), ("b", two), ("c", None), ("d", one)):
        scheduler.add_request(Request(req_id, [1, 2, 3], params, lora_request=lora))
    first = scheduler.schedule()
    assert [new.req_id for new in first.scheduled_new_reqs] == ["a", "c", "d"]
    assert [new.lora_request for new in first.scheduled_new_reqs] == [one, None, one]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    # Once no request of adapter "one" runs, "two" is admitted.
    from sparrow.core.request import RequestStatus

    scheduler.finish_requests(["a", "d"], RequestStatus.FINISHED_ABORTED)
    assert [new.req_id for new in scheduler.schedule().scheduled_new_reqs] == ["b"]


def test_prefix_cache_keys_name_the_adapter():
    from sparrow.core.kv_cache_utils import update_request_block_hashes
    from sparrow.core.request import Request
    from sparrow.sampling_params import SamplingParams

    def hashes(lora):
        return update_request_block_hashes(Request("r", list(range(32)), SamplingParams(), lora_request=lora), 16)

    base, one, two = hashes(None), hashes(LoRARequest("one", 1, "/a")), hashes(LoRARequest("two", 2, "/b"))
    assert len({base[0], one[0], two[0]}) == 3
    assert hashes(LoRARequest("one", 1, "/a")) == one
