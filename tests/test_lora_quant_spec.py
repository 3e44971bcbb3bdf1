"""Multi-LoRA with quantized weights and with speculative decoding (small test model, real engine).

Quantization (``quantization="int8"``, CPU W8A8): the adapter's update is computed in the
activation dtype and added to the quantized layer's output. An int8 model cannot have the adapter
merged into its weights, so the reference is the float32 engine with the same adapter on the int8
weights dequantized (tests/test_quantization.py's int8 reference): the teacher-forced prompt
logprobs of base and adapter requests (one mixed batch) must agree within that file's int8
tolerances (worst INT8_ATOL, mean INT8_MEAN_ATOL, top-1 on at least MIN_TOP1 of positions), while
the adapter moves the int8 model's logprobs by far more than that.

Speculative decoding: with n-gram, draft-model and EAGLE speculation, a batch mixing the base model
and two adapters gives the greedy tokens of the same engine without speculation, with drafts
accepted. The draft model and the EAGLE head draft without adapters (as in vLLM); the target
verifies every position, drafts included, with the request's adapter.
"""

from __future__ import annotations

import pytest

from sparrow import LLM, LoRARequest, SamplingParams
from sparrow.tiny.lora import build_lora_adapter
from tests.test_quantization import INT8_ATOL, INT8_MEAN_ATOL, MIN_TOP1, compare, prompts

ENGINE = dict(multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    specs = [dict(rank=8, alpha=16, seed=21),
             dict(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "down_proj"), seed=22)]
    return [LoRARequest(f"a{index}", index + 1, str(build_lora_adapter(qwen3_dir, root / f"a{index}", **spec)))
            for index, spec in enumerate(specs)]


# -- quantization ---------------------------------------------------------------------------------
def teacher_forced_with(model_dir: str, lora_requests: list, **kwargs):
    """tests/test_quantization.py's teacher-forced logprobs and top-1 tokens, for every prompt under
    every entry of ``lora_requests`` (one batch); -> {lora index: [(logprobs, top1) per prompt]}."""
    from sparrow.model_loader import get_hf_config

    token_prompts = prompts(get_hf_config(model_dir).vocab_size)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    batch = [(index, prompt) for prompt in token_prompts for index in range(len(lora_requests))]
    llm = LLM(model_dir, **{**ENGINE, **kwargs})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for _, p in batch], params, use_tqdm=False,
                               lora_request=[lora_requests[index] for index, _ in batch])
    finally:
        llm.shutdown()
    results: dict[int, list] = {index: [] for index in range(len(lora_requests))}
    for (index, _), output in zip(batch, outputs):
        logprobs, top1 = [], []
        for token, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
            logprobs.append(position[token].logprob)
            top1.append(next(t for t, lp in position.items() if lp.rank == 1))
        results[index].append((logprobs, top1))
    return results


def dequantized_copy(model_dir: str, out_dir) -> str:
    """tests/test_quantization.py's int8 reference: the model with its projections' per-channel
    int8 weights dequantized, run unquantized in float32 (only activation quantization differs)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sparrow.quantization.int8 import dequantize_rows
    from sparrow_cpu.int8 import quantize_weight

    shutil.copytree(model_dir, out_dir)
    state = load_file(str(out_dir / "model.safetensors"))
    for key, tensor in state.items():
        if ".layers." in key and key.endswith("_proj.weight"):
            state[key] = dequantize_rows(*quantize_weight(tensor))
    save_file(state, str(out_dir / "model.safetensors"))
    return str(out_dir)


def test_int8_with_an_adapter_matches_float32_with_it(qwen3_dir, adapters, tmp_path):
    choices = [None, adapters[0]]
    int8 = teacher_forced_with(qwen3_dir, choices, quantization="int8")
    fp32 = teacher_forced_with(dequantized_copy(qwen3_dir, tmp_path / "int8-ref"), choices)
    for index, label in enumerate(("base", "adapter")):
        worst, mean, top1 = compare(int8[index], fp32[index])
        assert worst < INT8_ATOL and mean < INT8_MEAN_ATOL and top1 >= MIN_TOP1, (label, worst, mean, top1)
    # The adapter is applied on the int8 path: it moves the logprobs far beyond int8's own error.
    _, adapter_effect, top1 = compare(int8[1], int8[0])
    assert adapter_effect > 10 * INT8_MEAN_ATOL and top1 < MIN_TOP1, (adapter_effect, top1)


# -- speculative decoding ---------------------------------------------------------------------------
TEXT = "the quick brown fox jumps over the lazy dog. "
SPEC_PROMPTS = [TEXT * 3, "def add(a, b):\n    return a + b\n" * 3, "1 2 3 4 5 6 7 8 9 10 11 12"]
SPEC_GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def spec_config(method: str, qwen3_dir: str, eagle_dir: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "draft_model":  # the target drafts for itself, without adapters
        return {"method": "draft_model", "model": qwen3_dir, "num_speculative_tokens": 3}
    return {"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 3}


def mixed_generate(llm: LLM, adapters: list[LoRARequest]) -> list[list[int]]:
    choices = [None, *adapters]
    batch = [(prompt, choice) for prompt in SPEC_PROMPTS for choice in choices]
    outputs = llm.generate([p for p, _ in batch], SPEC_GREEDY, use_tqdm=False, lora_request=[c for _, c in batch])
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def without_speculation(qwen3_dir, adapters) -> list[list[int]]:
    llm = LLM(qwen3_dir, **ENGINE)
    try:
        return mixed_generate(llm, adapters)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_speculation_gives_the_tokens_of_the_engine_without_it(qwen3_dir, adapters, without_speculation,
                                                                tmp_path, method):
    from sparrow.tiny.eagle import build_eagle_dir

    eagle_dir = str(build_eagle_dir(qwen3_dir, tmp_path / "eagle")) if method == "eagle" else ""
    llm = LLM(qwen3_dir, speculative_config=spec_config(method, qwen3_dir, eagle_dir), **ENGINE)
    try:
        got = mixed_generate(llm, adapters)
        stats = llm.llm_engine.last_stats
    finally:
        llm.shutdown()
    for index, (tokens, expected) in enumerate(zip(got, without_speculation)):
        assert tokens == expected, f"request {index} (adapter {index % 3 or 'none'}) differs with {method}"
    assert stats.spec_decode_num_accepted_tokens > 0, f"{method}: no draft accepted"
    # The adapters change the outputs (else this would not test that drafts are verified with them).
    assert without_speculation[0] != without_speculation[1] and without_speculation[0] != without_speculation[2]
