"""Gemma 2, Gemma 3 (text), Phi-3 and Mistral with a sliding window shorter than the prompts,
against HF transformers (eager attention, fp32).

Random-weight models with odd sizes (6 query heads on 2 KV heads, head_dim 16 over hidden 48,
windows of 12 tokens under 40-token prompts, small soft caps that bite, Gemma 3's two RoPE bases,
Phi-3's fused projections with partial LongRoPE) run through the real engine with chunked prefill,
prefix caching and a KV cache small enough to preempt: greedy tokens must equal transformers' and
logprobs agree within 1e-3.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparrow import LLM, SamplingParams

ATOL = 1e-3
PROMPT_LENGTHS = [3, 12, 13, 40]
MAX_TOKENS = 6
VOCAB = 512
ODD = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16, intermediate_size=80,
           vocab_size=VOCAB)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.3, 1.9, 2.5], long_factor=[1.5, 2.5, 4.0, 7.0],
                original_max_position_embeddings=256)

MODELS = {
    # layer 0 sliding, layer 1 global; soft caps small enough to change the scores and logits
    "gemma2": dict(arch="gemma2", sliding_window=12, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, tie_word_embeddings=True, **ODD),
    # sliding, global, sliding (a hybrid cache of three groups), with a RoPE base per kind
    "gemma3": dict(arch="gemma3", num_hidden_layers=3, sliding_window=12, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_theta=50000.0, rope_local_base_freq=10000.0, **ODD),
    # head_dim 16 = 96 / 6; RoPE on half of it, LongRoPE factors (short ones below 256 positions)
    "phi3": dict(arch="phi3", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=80,
                 vocab_size=VOCAB, sliding_window=12, partial_rotary_factor=0.5, rope_scaling=dict(LONGROPE),
                 original_max_position_embeddings=256),
    "mistral": dict(arch="mistral", sliding_window=12, vocab_size=VOCAB),
}


@pytest.fixture(scope="module")
def model_dirs_gp(tmp_path_factory) -> dict[str, str]:
    from tests.conftest import build_test_model

    root = tmp_path_factory.mktemp("gemma-phi")
    return {name: build_test_model(root / name, seed=index + 21, **dict(spec))
            for index, (name, spec) in enumerate(MODELS.items())}


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, VOCAB - 8) for _ in range(n)] for n in PROMPT_LENGTHS]


def run_engine(llm: LLM, prompts: list[list[int]]) -> tuple[list, int, int]:
    """(per prompt (tokens, logprob of each), preemptions so far, prompt tokens served from the cache)."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    finals, preemptions = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[int(out.request_id)] = out
        if engine.last_stats is not None:
            preemptions = engine.last_stats.num_preemptions  # cumulative
    results = []
    for index in range(len(prompts)):
        completion = finals[index].outputs[0]
        results.append((list(completion.token_ids),
                        [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)]))
    return results, preemptions, sum(finals[i].num_cached_tokens or 0 for i in finals)


def check_against_hf(results, reference) -> None:
    for index, ((tokens, logprobs), (hf_tokens, hf_logprobs)) in enumerate(zip(results, reference)):
        assert tokens == hf_tokens, f"prompt {index} (len {PROMPT_LENGTHS[index]}) differs from HF"
        for step, (token, ours) in enumerate(zip(tokens, logprobs)):
            theirs = hf_logprobs[step][token].item()
            assert abs(ours - theirs) < ATOL, f"prompt {index} step {step}: {ours} vs {theirs}"


# KV cache blocks of 8 slots that cannot hold the whole batch at once (a sliding-window group
# needs only the blocks of each request's window, and a hybrid model a block in each group).
PREEMPTING_BLOCKS = {"gemma2": 12, "gemma3": 20, "mistral": 6, "phi3": 6}


def engine(model_dir: str, num_kv_blocks: int) -> LLM:
    return LLM(model_dir, multiprocess=False, dtype="float32", max_model_len=128, enable_chunked_prefill=True,
               max_num_batched_tokens=16, enable_prefix_caching=True, num_kv_blocks=num_kv_blocks, block_size=8)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_engine_matches_hf_with_chunking_prefix_cache_and_preemption(name, model_dirs_gp):
    from tests.test_parity import hf_greedy

    model_dir = model_dirs_gp[name]
    prompts = make_prompts(seed=len(name))
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = engine(model_dir, num_kv_blocks=64)
    try:
        first, _, _ = run_engine(llm, prompts)
        second, _, cached = run_engine(llm, prompts)  # served in part from the prefix cache
    finally:
        llm.shutdown()
    check_against_hf(first, reference)
    check_against_hf(second, reference)
    assert cached > 0, "the second pass should hit the prefix cache"
    llm = engine(model_dir, num_kv_blocks=PREEMPTING_BLOCKS[name])
    try:
        third, preemptions, _ = run_engine(llm, prompts)
    finally:
        llm.shutdown()
    check_against_hf(third, reference)
    assert preemptions > 0, "the small KV cache should have forced a preemption"


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_disable_sliding_window_attends_to_the_window_cut_context_as_hf(name, model_dirs_gp):
    """vLLM's disable_sliding_window: full attention in every layer, max_model_len cut to the
    window (12), so the outputs are HF's; Gemma 3's sliding layers keep their local RoPE."""
    from sparrow.config import ConfigError
    from sparrow.layers.attention import Attention
    from tests.test_parity import hf_greedy

    model_dir = model_dirs_gp[name]
    prompts = [prompt[:5] for prompt in make_prompts(seed=7)[:3]]  # 3 and 5 tokens, + 6 out <= 12
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(model_dir, multiprocess=False, dtype="float32", disable_sliding_window=True)
    try:
        assert llm.llm_engine.config.model.max_model_len == 12
        windows = llm.apply_model(lambda model: [module.sliding_window for module in model.modules()
                                                 if isinstance(module, Attention)])
        assert windows[0] and set(windows[0]) == {None}
        engine = llm.llm_engine
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
        results = [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                   o.outputs[0].logprobs)])
                   for o in outputs]
        check_against_hf(results, reference)
        assert engine.kv_cache_capacity_tokens >= 12
    finally:
        llm.shutdown()
    with pytest.raises(ConfigError, match="'max_model_len': 64 exceeds the model's maximum 12 .*disable_sliding"):
        LLM(model_dir, multiprocess=False, disable_sliding_window=True, max_model_len=64)


# -- layer-level checks ---------------------------------------------------------------------------

def test_layers_carry_their_window_soft_cap_and_rope(model_dirs_gp):
    from sparrow.model_loader import load_model
    from sparrow_cpu.attention import TorchPagedAttention

    gemma2 = load_model(model_dirs_gp["gemma2"], TorchPagedAttention, torch.float32, "cpu")
    attn = [layer.self_attn.attn.backend_kwargs for layer in gemma2.model.layers]
    assert attn == [{"sliding_window": 12, "logits_soft_cap": 2.0}, {"logits_soft_cap": 2.0}]
    assert gemma2.attn_backend.scale == pytest.approx(24 ** -0.5)
    gemma3 = load_model(model_dirs_gp["gemma3"], TorchPagedAttention, torch.float32, "cpu")
    layers = gemma3.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [12, None, 12]
    local, full = (layer.self_attn.rotary_emb.cos_sin_cache for layer in layers[:2])
    assert layers[0].self_attn.rotary_emb is layers[2].self_attn.rotary_emb
    # position 1, first frequency: cos(1 * base^0) is the same; the second frequency differs by base
    assert local[1, 1] == pytest.approx(torch.cos(torch.tensor(10000.0 ** (-2 / 16))).item(), abs=1e-6)
    assert full[1, 1] == pytest.approx(torch.cos(torch.tensor(50000.0 ** (-2 / 16))).item(), abs=1e-6)


def test_longrope_cache_matches_transformers_on_both_sides_of_the_original_length(model_dirs_gp):
    """Short factors below original_max_position_embeddings, long ones from it on: what
    transformers uses for a sequence up to that length and for one past it, respectively."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from sparrow.layers.rotary import get_rope

    config = AutoConfig.from_pretrained(model_dirs_gp["phi3"], local_files_only=True)
    ours = get_rope(config, 16).cos_sin_cache  # [2048, 8]: cos | sin of 4 frequencies
    theirs = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    for length in (200, 300):  # up to the original length (256), and past it
        cos, sin = theirs(x, torch.arange(length)[None])
        rows = slice(0, length) if length <= 256 else slice(256, length)
        expected = torch.cat([cos[0, rows, :4], sin[0, rows, :4]], dim=-1)
        torch.testing.assert_close(ours[rows], expected, atol=1e-5, rtol=1e-5)


def test_unsupported_configs_are_refused_naming_the_field(model_dirs_gp):
    from transformers import AutoConfig

    from sparrow.layers.rotary import get_rope
    from sparrow.models.gemma2 import Gemma2ForCausalLM
    from sparrow_cpu.attention import TorchPagedAttention

    config = AutoConfig.from_pretrained(model_dirs_gp["phi3"], local_files_only=True)
    config.rope_parameters = dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic'.*rope_parameters"):
        get_rope(config, 16)
    config.rope_parameters = dict(LONGROPE, rope_theta=10000.0, short_factor=[1.0])
    with pytest.raises(ValueError, match="'short_factor' must be a list of"):
        get_rope(config, 16)
    gemma = AutoConfig.from_pretrained(model_dirs_gp["gemma2"], local_files_only=True)
    gemma.hidden_activation = "gelu"
    with pytest.raises(ValueError, match="hidden_activation 'gelu'"):
        Gemma2ForCausalLM(gemma, TorchPagedAttention, torch.float32, "cpu")


def test_phi3_rejects_a_misshapen_fused_tensor(model_dirs_gp):
    from sparrow.model_loader import iter_safetensors, load_model
    from sparrow_cpu.attention import TorchPagedAttention

    model = load_model(model_dirs_gp["phi3"], TorchPagedAttention, torch.float32, "cpu")
    weights = [(name, tensor[:-1] if name.endswith("0.self_attn.qkv_proj.weight") else tensor)
               for name, tensor in iter_safetensors(model_dirs_gp["phi3"])]
    with pytest.raises(ValueError, match="qkv_proj.weight.*expected 160 rows"):
        model.load_weights(weights)
