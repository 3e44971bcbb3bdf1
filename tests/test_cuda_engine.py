"""The CUDA platform end to end (skipped without a GPU)."""

from __future__ import annotations

import random

import pytest

from sparrow import LLM, SamplingParams

pytestmark = pytest.mark.cuda


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 4000) for _ in range(rng.randrange(1, 300))] for _ in range(n)]


def generate(model_dir, prompt_ids, params, **engine_args):
    engine_args.setdefault("max_model_len", 512)
    llm = LLM(model_dir, device="cuda", multiprocess=False, **engine_args)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp32_greedy_matches_hf_on_gpu(model_dirs, arch):
    from tests.test_parity import hf_greedy

    prompt_ids = prompts(6, seed=1)
    reference = hf_greedy(model_dirs[arch], prompt_ids, 8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = generate(model_dirs[arch], prompt_ids, params, dtype="float32", enforce_eager=True)
    for output, (tokens, logprobs) in zip(outputs, reference):
        assert output.outputs[0].token_ids == tokens
        for step, token in enumerate(tokens):
            assert abs(output.outputs[0].logprobs[step][token].logprob - logprobs[step][token].item()) < 1e-3


def test_bf16_prompt_logprobs_close_to_hf(qwen3_dir):
    import torch

    from tests.test_parity import hf_prompt_logprobs

    prompt = prompts(1, seed=3)[0]
    reference = hf_prompt_logprobs(qwen3_dir, prompt)  # fp32 on CPU
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    output = generate(qwen3_dir, [prompt], params, dtype="bfloat16")[0]
    diffs = [abs(output.prompt_logprobs[i][prompt[i]].logprob - reference[i - 1][prompt[i]].item())
             for i in range(1, len(prompt))]
    assert torch.tensor(diffs).mean() < 0.05 and max(diffs) < 0.5


def test_cuda_graphs_and_eager_give_the_same_tokens(qwen3_dir):
    prompt_ids = prompts(20, seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = generate(qwen3_dir, prompt_ids, params, dtype="bfloat16", enforce_eager=True)
    graphs = generate(qwen3_dir, prompt_ids, params, dtype="bfloat16", enforce_eager=False)
    assert [o.outputs[0].token_ids for o in eager] == [o.outputs[0].token_ids for o in graphs]


def test_kv_cache_fills_the_memory_it_was_given(qwen3_dir):
    llm = LLM(qwen3_dir, device="cuda", multiprocess=False, max_model_len=512, gpu_memory_utilization=0.5)
    try:
        info = llm.llm_engine.engine_core.call_utility("get_kv_cache_info")
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(64, seed=4)], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert info["num_blocks"] > 1000
    assert all(len(o.outputs[0].token_ids) == 64 for o in outputs)
