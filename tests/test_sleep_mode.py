"""RLHF on a colocated engine, as verl and OpenRLHF drive vLLM: sleep to free the memory, wake up,
load new weights through ``model.load_weights`` (called by a worker function), and generate with
them. The reference is HF transformers on each checkpoint: the engine's greedy tokens equal HF's on
the first checkpoint, then on the second after its weights are loaded into the running engine
(the CPU platform repacks its oneDNN linears and the tied LM head for each load)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sparrow import LLM, SamplingParams

from .conftest import build_test_model

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]},
           {"prompt_token_ids": [30, 31, 32]}]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def hf_greedy(model_dir: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    results = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = prompt["prompt_token_ids"]
            out = model.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
            results.append(out[0, len(ids):].tolist())
    return results


def tokens(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def load_checkpoint(llm: LLM, model_dir: str) -> list[int]:
    """An RLHF weight sync: every tensor of ``model_dir`` through ``model.load_weights``, one call per
    tensor, as trainers send them; then the prefix cache is reset (its KV came from old weights)."""
    weights = load_file(f"{model_dir}/model.safetensors")

    def sync(model):
        return sum(len(model.load_weights(weights=[(name, tensor)])) for name, tensor in weights.items())

    counts = llm.apply_model(sync)
    llm.reset_prefix_cache()
    return counts


@pytest.fixture(scope="module")
def checkpoints(model_dirs, tmp_path_factory):
    """Two checkpoints of one tied-embedding architecture (so the LM head shares the embedding's
    table), and HF's greedy tokens on each."""
    first = model_dirs["qwen2"]
    second = build_test_model(tmp_path_factory.mktemp("second") / "qwen2", arch="qwen2", seed=11,
                              tie_word_embeddings=True)
    return {"first": (first, hf_greedy(first)), "second": (second, hf_greedy(second))}


@pytest.fixture(scope="module")
def llm(checkpoints):
    engine = LLM(checkpoints["first"][0], dtype="float32", max_model_len=64, num_kv_blocks=16,
                 enable_sleep_mode=True)
    yield engine
    engine.shutdown()


def test_weights_loaded_into_the_running_engine_are_what_it_runs(llm, checkpoints):
    (_, first), (second_dir, second) = checkpoints["first"], checkpoints["second"]
    assert first != second  # the two checkpoints disagree, so the comparison below means something
    assert tokens(llm) == first
    assert load_checkpoint(llm, second_dir)[0] > 0
    assert tokens(llm) == second
    # vLLM's reload_weights reads the engine's own checkpoint again.
    llm.collective_rpc("reload_weights")
    llm.reset_prefix_cache()
    assert tokens(llm) == first


def test_sleep_releases_the_memory_and_wake_up_takes_it_back(llm, checkpoints):
    first = checkpoints["first"][1]

    def kv_bytes(worker):
        return worker.model_runner.kv_caches[0].untyped_storage().nbytes()

    [held] = llm.collective_rpc(kv_bytes)
    assert held > 0 and not llm.is_sleeping()
    llm.sleep(level=1)
    assert llm.is_sleeping() and llm.collective_rpc(kv_bytes) == [0]
    with pytest.raises(ValueError, match=r"asleep.*wake_up\(\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache still sleeps
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and llm.collective_rpc(kv_bytes) == [held]
    assert tokens(llm) == first  # level 1 kept the weights (in host memory on the CPU)


def packed_bytes(model) -> int:
    """Bytes of the oneDNN-packed weights the CPU linears hold (0 where they are dropped)."""
    impls = [module._op_impl for module in model.modules() if getattr(module, "_op_impl", None) is not None]
    return sum(impl.packed.numel() * impl.packed.element_size() for impl in impls
               if getattr(impl, "packed", None) is not None)


def test_level_two_discards_the_weights_and_an_rlhf_update_fills_them(llm, checkpoints):
    (_, first), (second_dir, second) = checkpoints["first"], checkpoints["second"]
    [held] = llm.apply_model(packed_bytes)
    llm.sleep(level=2)
    [asleep] = llm.apply_model(packed_bytes)
    if held:  # oneDNN packs the linears on this build: level 2 frees them too
        assert asleep == 0
    llm.wake_up(tags=["weights"])
    assert llm.apply_model(packed_bytes) == [held]  # zeros again, packed
    [norm] = llm.apply_model(lambda model: float(model.model.norm.weight.abs().sum()))
    assert norm == 0.0  # discarded: nothing is left of the old weights until new ones load
    load_checkpoint(llm, second_dir)
    llm.wake_up(tags=["kv_cache"])
    assert tokens(llm) == second
    llm.sleep(level=2)
    llm.wake_up()
    llm.collective_rpc("reload_weights")
    assert tokens(llm) == first


def test_bad_calls_are_value_errors_and_the_engine_carries_on(llm, checkpoints, qwen3_dir):
    for call, match in [(lambda: llm.sleep(level=3), "level must be 1"),
                        (lambda: llm.sleep(level=True), "level must be 1"),
                        (lambda: llm.wake_up(tags="weights"), "tags must be a list"),
                        (lambda: llm.wake_up(tags=["weights", "activations"]), "tags must be a list")]:
        with pytest.raises(ValueError, match=match):
            call()
    engine = llm.llm_engine
    engine.add_request("in-flight", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="1 requests are in flight or held by a pause"):
        llm.sleep()
    assert not llm.is_sleeping()
    engine.abort_request(["in-flight"])
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="has no parameter for checkpoint tensors: model.nothing"):
        llm.apply_model(lambda model: model.load_weights([("model.nothing", torch.zeros(1))]))
    assert tokens(llm) == checkpoints["first"][1]


def test_sleep_needs_enable_sleep_mode(qwen3_dir):
    llm = LLM(qwen3_dir, dtype="float32", max_model_len=64, num_kv_blocks=8)
    try:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            llm.sleep()
        assert not llm.is_sleeping()
    finally:
        llm.shutdown()
