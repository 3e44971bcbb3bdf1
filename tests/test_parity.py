"""The whole engine (LLM -> scheduler -> CPU worker -> sampler) against HF transformers.

Greedy token ids must be identical and logprobs within 1e-4 in fp32, for a batch mixing prompt
lengths 1..300: plainly, with chunked prefill at a 16-token budget, on a second pass served from the
prefix cache, and with a KV cache so small that requests are preempted.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparrow import LLM, SamplingParams

PROMPT_LENGTHS = [1, 2, 7, 16, 17, 33, 64, 120, 300]
MAX_TOKENS = 8
ATOL = 1e-4


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab_size - 8) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int, attn_implementation: str = "eager"):
    """Per prompt: greedy token ids and, per step, the log-softmax of HF's raw logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attn_implementation, local_files_only=True)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [step[0].float().log_softmax(-1) for step in out.logits]
            results.append((tokens, logprobs))
    return results


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)  # [len, vocab]; row i predicts token i+1


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_case(request, model_dirs):
    from sparrow.model_loader import get_hf_config

    model_dir = model_dirs[request.param]
    prompts = make_prompts(get_hf_config(model_dir).vocab_size, seed=len(request.param))
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


def check_against_hf(outputs, reference, atol: float = ATOL):
    for index, (output, (hf_tokens, hf_logprobs)) in enumerate(zip(outputs, reference)):
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, \
            f"prompt {index} (len {len(output.prompt_token_ids)}) differs from HF"
        for step, (token_id, position_logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
            ours = position_logprobs[token_id].logprob
            theirs = hf_logprobs[step][token_id].item()
            assert abs(ours - theirs) < atol, f"prompt {index} step {step}: {ours} vs {theirs}"


def engine_run(model_dir, prompts, **engine_args):
    engine_args.setdefault("max_model_len", 512)
    engine_args.setdefault("dtype", "float32")
    llm = LLM(model_dir, multiprocess=False, **engine_args)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    try:
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return first, second


def test_greedy_batch_matches_hf(arch_case):
    model_dir, prompts, reference = arch_case
    first, second = engine_run(model_dir, prompts)
    check_against_hf(first, reference)
    # The second pass is served from the prefix cache.
    assert sum(o.num_cached_tokens for o in second) > 0
    check_against_hf(second, reference)


def test_chunked_prefill_at_16_token_budget_matches_hf(arch_case):
    model_dir, prompts, reference = arch_case
    first, _ = engine_run(model_dir, prompts, max_num_batched_tokens=16, enable_prefix_caching=False)
    check_against_hf(first, reference)


def test_preemption_under_a_tiny_kv_cache_matches_hf(arch_case):
    model_dir, prompts, reference = arch_case
    # 24 blocks of 16 tokens = 384 slots: the 300-token prompt fits alone, not with the others.
    first, second = engine_run(model_dir, prompts, num_kv_blocks=24, block_size=16)
    check_against_hf(first, reference)
    check_against_hf(second, reference)


def test_prompt_logprobs_match_teacher_forced_hf(model_dirs):
    model_dir = model_dirs["qwen3"]
    prompt = make_prompts(4000, seed=7)[7]  # 120 tokens
    reference = hf_prompt_logprobs(model_dir, prompt)
    llm = LLM(model_dir, multiprocess=False, dtype="float32", max_model_len=512, max_num_batched_tokens=48)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0)
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        token_id = prompt[position]
        expected = reference[position - 1]
        assert abs(entry[token_id].logprob - expected[token_id].item()) < ATOL
        # Ranks deep in the tail may swap tokens whose logprobs differ by float noise.
        near = int(((expected - expected[token_id]).abs() < ATOL).sum()) - 1
        assert abs(entry[token_id].rank - (int((expected > expected[token_id]).sum()) + 1)) <= near
        top = int(expected.argmax())
        assert top in entry and abs(entry[top].logprob - expected[top].item()) < ATOL
