"""kv_cache_dtype="bfloat16" on the CPU: a float32 model's KV cache stored in bfloat16.

The reference is HF transformers on the same directory in float32 with an attention function that
rounds every key and value to bfloat16 before attending (what a bfloat16 cache holds): greedy tokens
equal and logprobs within BF16_ATOL, plainly, with chunked prefill, from the prefix cache and under
preemption, with the C++ decode kernel and with the torch path. The tolerance is wider than fp32's
1e-4: a float32 difference of one ulp in a key can round it to the neighbouring bfloat16 value (a
step of 2^-8 relative), and both engines round independently computed keys. Measured: 2.2e-4 at
worst, where the same HF model with float32 keys and values differs by about 1e-2 (checked below,
so that the comparison can tell the two apart).
"""

from __future__ import annotations

import random

import pytest
import torch

from sparrow import LLM
from sparrow.config import ConfigError, EngineConfig
from tests.test_parity import MAX_TOKENS, check_against_hf, engine_run, hf_greedy

PROMPT_LENGTHS = [1, 7, 17, 64, 150]
BF16_ATOL = 1e-3
BF16_KV = {"kv_cache_dtype": "bfloat16"}


def prompts_for(vocab_size: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(0, vocab_size - 8) for _ in range(n)] for n in PROMPT_LENGTHS]


def bf16_kv_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    return eager_attention_forward(module, query, key.to(torch.bfloat16).float(), value.to(torch.bfloat16).float(),
                                   attention_mask, **kwargs)


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """HF with keys and values rounded to bfloat16: the prompts, and per prompt greedy tokens and
    per-step logprobs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from sparrow.model_loader import get_hf_config

    # A registered attention function also needs its mask function (without one HF passes none,
    # and the prompt is attended without a causal mask).
    AttentionInterface.register("sparrow_test_bf16_kv", bf16_kv_attention)
    AttentionMaskInterface.register("sparrow_test_bf16_kv", eager_mask)
    prompts = prompts_for(get_hf_config(qwen3_dir).vocab_size)
    return prompts, hf_greedy(qwen3_dir, prompts, MAX_TOKENS, attn_implementation="sparrow_test_bf16_kv")


def test_the_reference_is_not_float32s(qwen3_dir, reference):
    """The rounding matters at this tolerance: HF with float32 keys and values is farther away."""
    from transformers import AutoModelForCausalLM

    prompts, expected = reference
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True)
    worst = 0.0
    with torch.inference_mode():
        for prompt, (tokens, logprobs) in zip(prompts, expected):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            worst = max(worst, max(abs(logits[step, token].item() - logprobs[step][token].item())
                                   for step, token in enumerate(tokens)))
    assert worst > 5 * BF16_ATOL, worst


@pytest.mark.parametrize("attention", ["cpp", "torch"])
def test_greedy_batch_matches_hf_with_bf16_keys_and_values(qwen3_dir, reference, attention, monkeypatch):
    if attention == "torch":
        monkeypatch.setenv("SPARROW_CPU_NATIVE_ATTENTION", "0")
    prompts, expected = reference
    first, second = engine_run(qwen3_dir, prompts, **BF16_KV)
    check_against_hf(first, expected, atol=BF16_ATOL)
    assert sum(o.num_cached_tokens for o in second) > 0  # the second pass reads the prefix cache
    check_against_hf(second, expected, atol=BF16_ATOL)


def test_chunked_prefill_and_preemption_match_hf(qwen3_dir, reference):
    prompts, expected = reference
    chunked, _ = engine_run(qwen3_dir, prompts, max_num_batched_tokens=16, enable_prefix_caching=False, **BF16_KV)
    check_against_hf(chunked, expected, atol=BF16_ATOL)
    # 16 blocks of 16 tokens: the 150-token prompt and its output fit alone, not with the others.
    first, second = engine_run(qwen3_dir, prompts, num_kv_blocks=16, block_size=16, **BF16_KV)
    check_against_hf(first, expected, atol=BF16_ATOL)
    check_against_hf(second, expected, atol=BF16_ATOL)


def test_the_same_memory_holds_twice_the_tokens(monkeypatch):
    """kv_cache_memory_bytes buys twice the blocks of a float32 cache (sparrow-tiny: 16 KiB a token
    in float32, 8 KiB in bfloat16)."""
    budget = 1 << 25
    blocks = {}
    for kv_cache_dtype in ("auto", "bfloat16"):
        with LLM(max_model_len=256, kv_cache_memory_bytes=budget, kv_cache_dtype=kv_cache_dtype,
                 multiprocess=False) as llm:
            info = llm.llm_engine.engine_core.call_utility("get_kv_cache_info")
            blocks[kv_cache_dtype] = info["num_blocks"] * info["block_size"]
            runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
            expected = torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32
            assert all(cache.dtype == expected for cache in runner.kv_caches)
    assert blocks["auto"] * 16 * 1024 == budget, blocks
    assert blocks["bfloat16"] == 2 * blocks["auto"], blocks


def test_accepted_on_cpu_refused_elsewhere_naming_the_field():
    from sparrow.engine.preflight import check_platform_settings
    from sparrow.engine.setup import finalize_config
    from sparrow_cuda.platform import CudaPlatform

    assert finalize_config(EngineConfig.from_kwargs(device="cpu", kv_cache_dtype="bfloat16")).cache.kv_cache_dtype \
        == "bfloat16"
    config = EngineConfig.from_kwargs(kv_cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"'kv_cache_dtype'.*'bfloat16'.*platform 'cuda'.*supported: auto, fp8"):
        check_platform_settings(config, CudaPlatform(), None)


def test_the_kernel_reads_a_bf16_cache_like_the_torch_path():
    """The C++ decode kernel over a bfloat16 cache with float32 queries, against the same
    attention in float64 over the cache's values (GQA, a block table out of order, ragged lengths)."""
    from sparrow_cpu.native import get_paged_attention

    kernel = get_paged_attention()
    if kernel is None:
        pytest.skip("the C++ kernels cannot be built here")
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 12
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor([5, 33, 48], dtype=torch.int32)
    block_table = torch.tensor([[7, 0, 0], [3, 11, 1], [2, 9, 4]], dtype=torch.int32)
    query = torch.randn(3, num_heads, head_dim, generator=gen)
    out = torch.zeros_like(query)
    rows = torch.arange(3, dtype=torch.int64)
    scale = head_dim ** -0.5
    kernel(query, cache, out, rows, rows, torch.arange(4, dtype=torch.int32), seq_lens, block_table, scale, 0, 0.0)
    group = num_heads // num_kv_heads
    for r in range(3):
        n = int(seq_lens[r])
        blocks = block_table[r, : -(-n // block_size)].long()
        keys = cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:n].double()
        values = cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:n].double()
        for h in range(num_heads):
            probs = (keys[:, h // group] @ query[r, h].double() * scale).softmax(0)
            torch.testing.assert_close(out[r, h].double(), probs @ values[:, h // group], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 queries over a bfloat16 cache"):
        kernel(query.to(torch.bfloat16), cache.float(), out.to(torch.bfloat16), rows, rows,
               torch.arange(4, dtype=torch.int32), seq_lens, block_table, scale, 0, 0.0)
