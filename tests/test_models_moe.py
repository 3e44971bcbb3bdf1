"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against HF transformers, and the fused_moe op.

Random-weight models with odd sizes (5 or 6 experts, top-2/top-3, GQA 6:2 heads, a dense layer
mixed in, ``norm_topk_prob`` both ways) run through the real engine with chunked prefill, prefix
caching and a KV cache small enough to preempt; greedy tokens must equal transformers' (eager, fp32)
and logprobs agree within 1e-3. Tensor parallel 2 must give tensor parallel 1's tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.layers.fused_moe import FusedMoE, SparseMoeBlock, select_experts
from sparrow.layers.parallel import ParallelContext
from sparrow.model_loader import iter_safetensors, load_model
from sparrow.models.llama import LlamaMLP, MissingWeightsError
from sparrow_cpu.attention import TorchPagedAttention

ATOL = 1e-3
TP_ATOL = 1e-4
PROMPT_LENGTHS = [1, 9, 23, 40, 61]
MAX_TOKENS = 6
COMMON = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16, vocab_size=512)

MODELS = {
    # layer 0 sparse (5 experts, top-3, renormalised), layer 1 dense via mlp_only_layers
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=5, num_experts_per_tok=3, moe_intermediate_size=40,
                      intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1], **COMMON),
    # layer 0 dense via decoder_sparse_step=2, layer 1 sparse (6 experts, top-2, not renormalised)
    "qwen3_moe_raw": dict(arch="qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                          intermediate_size=80, norm_topk_prob=False, decoder_sparse_step=2, **COMMON),
    "mixtral": dict(arch="mixtral", num_local_experts=5, num_experts_per_tok=3, intermediate_size=40, **COMMON),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    from tests.conftest import build_test_model

    root = tmp_path_factory.mktemp("moe")
    return {name: build_test_model(root / name, seed=index + 11, **spec)
            for index, (name, spec) in enumerate(MODELS.items())}


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


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
            preemptions = engine.last_stats.num_preemptions  # cumulative since the engine started
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


@pytest.mark.parametrize("name", sorted(MODELS))
def test_engine_matches_hf_with_chunking_prefix_cache_and_preemption(name, moe_dirs):
    from tests.test_parity import hf_greedy

    model_dir = moe_dirs[name]
    prompts = make_prompts(seed=len(name))
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
    # 6 blocks of 16 slots: the longest request (67 tokens) fits alone, the batch does not.
    llm = LLM(model_dir, multiprocess=False, dtype="float32", max_model_len=128, enable_chunked_prefill=True,
              max_num_batched_tokens=16, enable_prefix_caching=True, num_kv_blocks=6, block_size=16)
    try:
        first, preemptions, _ = run_engine(llm, prompts)
        # Reversed: the last prompts computed still have their blocks cached in the tiny cache.
        second, _, cached = run_engine(llm, prompts[::-1])
    finally:
        llm.shutdown()
    assert preemptions > 0, "the small KV cache should have forced a preemption"
    assert cached > 0, "the second pass should hit the prefix cache"
    check_against_hf(first, reference)
    check_against_hf(second[::-1], reference)


@pytest.mark.parametrize(("name", "layouts"), [
    ("qwen3_moe", ((2, False), (2, True))),  # 5 experts: 3 on rank 0 and 2 on rank 1 with expert parallelism
    ("mixtral", ((2, False),)),
])
def test_tp2_gives_the_tokens_of_tp1(name, layouts, moe_dirs):
    model_dir = moe_dirs[name]
    prompts = make_prompts(seed=3)
    args = dict(multiprocess=False, dtype="float32", max_model_len=128, max_num_batched_tokens=32)
    results = {}
    for tp, expert_parallel in ((1, False), *layouts):
        llm = LLM(model_dir, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel, **args)
        try:
            if expert_parallel:  # whole experts per rank: 3 and 2 of the sparse layer's (layer 0) 5
                assert llm.apply_model(lambda model: model.model.layers[0].mlp.experts.num_local_experts) == [3, 2]
            results[tp, expert_parallel], _, _ = run_engine(llm, prompts)
        finally:
            llm.shutdown()
    for layout in layouts:
        for index, ((tokens1, logprobs1), (tokens2, logprobs2)) in enumerate(zip(results[1, False], results[layout])):
            assert tokens2 == tokens1, f"prompt {index} differs with {layout}"
            assert logprobs2 == pytest.approx(logprobs1, abs=TP_ATOL), f"prompt {index} logprobs differ with {layout}"


# -- structure and loading ------------------------------------------------------------------------

def test_dense_and_sparse_layers_follow_the_config(moe_dirs):
    layers = {name: load_model(moe_dirs[name], TorchPagedAttention, torch.float32, "cpu").model.layers
              for name in MODELS}
    assert isinstance(layers["qwen3_moe"][0].mlp, SparseMoeBlock) and isinstance(layers["qwen3_moe"][1].mlp, LlamaMLP)
    assert isinstance(layers["qwen3_moe_raw"][0].mlp, LlamaMLP)
    assert isinstance(layers["qwen3_moe_raw"][1].mlp, SparseMoeBlock)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in layers["mixtral"])
    block = layers["qwen3_moe"][0].mlp
    assert (block.top_k, block.renormalize) == (3, True) and not layers["qwen3_moe_raw"][1].mlp.renormalize
    assert tuple(block.experts.gate_up_proj.shape) == (5, 80, 64)
    assert tuple(block.experts.down_proj.shape) == (5, 64, 40)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_block_matches_hf_layer(name, moe_dirs):
    from transformers import AutoModelForCausalLM

    model = load_model(moe_dirs[name], TorchPagedAttention, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(moe_dirs[name], dtype=torch.float32).eval()
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = hf.model.layers[0].mlp(x)[0]
        got = model.model.layers[0].mlp(x[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_transformers5_fused_expert_names_load(name, moe_dirs):
    """transformers 5's in-memory names (stacked experts, Mixtral's ``mlp``) load like the hub layout."""
    from transformers import AutoModelForCausalLM

    hub = load_model(moe_dirs[name], TorchPagedAttention, torch.float32, "cpu")
    state = AutoModelForCausalLM.from_pretrained(moe_dirs[name], dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    fused = type(hub)(hub.config, TorchPagedAttention, torch.float32, "cpu")
    fused.load_weights(state.items())
    for (param_name, want), (_, got) in zip(hub.named_parameters(), fused.named_parameters()):
        assert torch.equal(got, want), param_name


def test_missing_expert_tensor_is_named(moe_dirs):
    model_dir = moe_dirs["mixtral"]
    model = load_model(model_dir, TorchPagedAttention, torch.float32, "cpu")
    fresh = type(model)(model.config, TorchPagedAttention, torch.float32, "cpu")
    dropped = "model.layers.1.block_sparse_moe.experts.4.w3.weight"
    with pytest.raises(MissingWeightsError, match=dropped.replace(".", r"\.")):
        fresh.check_loaded(fresh.load_weights((n, t) for n, t in iter_safetensors(model_dir) if n != dropped))


@pytest.mark.parametrize("world_size", [2])  # 6 query heads: 2 is the size that divides them
def test_tensor_parallel_expert_slices_sum_to_the_whole(moe_dirs, world_size):
    """Each rank loads (through lazy slices) its slice of every expert; the partial outputs sum to
    the single-device output."""
    model_dir = moe_dirs["qwen3_moe"]
    full = load_model(model_dir, TorchPagedAttention, torch.float32, "cpu")
    experts = full.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(9, 64, generator=gen)
    weights, ids = select_experts(torch.randn(9, 5, generator=gen), 3, True)
    total = torch.zeros(9, 64)
    for rank in range(world_size):
        tp = ParallelContext(rank=rank, world_size=world_size)
        model = type(full)(full.config, TorchPagedAttention, torch.float32, "cpu", tp)
        model.load_weights(iter_safetensors(model_dir, tp))
        part = model.model.layers[0].mlp.experts
        inter = 40 // world_size
        mine = slice(rank * inter, (rank + 1) * inter)
        full_inter = experts.intermediate_size
        assert torch.equal(part.gate_up_proj[:, :inter], experts.gate_up_proj[:, mine])
        assert torch.equal(part.gate_up_proj[:, inter:], experts.gate_up_proj[:, full_inter:][:, mine])
        assert torch.equal(part.down_proj, experts.down_proj[:, :, mine])
        total += part.forward_native(hidden, weights, ids)
    torch.testing.assert_close(total, experts.forward_native(hidden, weights, ids), atol=1e-5, rtol=1e-5)


def test_expert_parallel_ranks_hold_whole_experts_and_sum_to_the_whole(moe_dirs):
    """Expert parallelism: each rank loads whole experts of its range (5 experts over 2 ranks: 3 and
    2), and the ranks' outputs sum to the single-device output."""
    from sparrow.layers.fused_moe import expert_range

    world_size = 2
    model_dir = moe_dirs["qwen3_moe"]
    full = load_model(model_dir, TorchPagedAttention, torch.float32, "cpu")
    experts = full.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(11, 64, generator=gen)
    weights, ids = select_experts(torch.randn(11, 5, generator=gen), 3, True)
    total, owned = torch.zeros(11, 64), []
    for rank in range(world_size):
        tp = ParallelContext(rank=rank, world_size=world_size, expert_parallel=True)
        model = type(full)(full.config, TorchPagedAttention, torch.float32, "cpu", tp)
        model.load_weights(iter_safetensors(model_dir, tp))
        part = model.model.layers[0].mlp.experts
        first, count = expert_range(5, rank, world_size)
        assert (part.first_expert, part.num_local_experts) == (first, count)
        owned += range(first, first + count)
        assert torch.equal(part.gate_up_proj, experts.gate_up_proj[first:first + count])
        assert torch.equal(part.down_proj, experts.down_proj[first:first + count])
        total += part.forward_native(hidden, weights, ids)
    assert owned == list(range(5))
    torch.testing.assert_close(total, experts.forward_native(hidden, weights, ids), atol=1e-5, rtol=1e-5)


def test_expert_ranges_spread_the_remainder_and_the_op_loads_stacked_experts():
    from sparrow.layers.fused_moe import expert_range

    assert [expert_range(7, rank, 3) for rank in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert [expert_range(4, rank, 4) for rank in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    gen = torch.Generator().manual_seed(9)
    whole = FusedMoE(7, 16, 12)
    gate_up, down = torch.randn(7, 24, 16, generator=gen), torch.randn(7, 16, 12, generator=gen)
    whole.weight_loader(whole.gate_up_proj, gate_up)
    whole.weight_loader(whole.down_proj, down)
    hidden = torch.randn(13, 16, generator=gen)
    weights, ids = select_experts(torch.randn(13, 7, generator=gen), 2, False)
    total = torch.zeros(13, 16)
    for rank in range(3):
        part = FusedMoE(7, 16, 12, tp=ParallelContext(rank=rank, world_size=3, expert_parallel=True))
        part.weight_loader(part.gate_up_proj, gate_up)  # the stacked layout (transformers 5)
        for expert in range(7):  # and one expert at a time (the hub layout): another rank's are skipped
            part.weight_loader(part.down_proj, down[expert], ("down", expert))
        total += part.forward_native(hidden, weights, ids)
    torch.testing.assert_close(total, whole.forward_native(hidden, weights, ids), atol=1e-5, rtol=1e-5)


def test_expert_parallel_is_refused_where_it_cannot_split_naming_it(moe_dirs, qwen3_dir):
    from sparrow.config import ConfigError

    for model_dir, extra, phrase in ((qwen3_dir, {}, "has no experts"),
                                     (moe_dirs["qwen3_moe"], dict(data_parallel_size=2), "data-parallel engines"),
                                     (moe_dirs["qwen3_moe"], dict(tensor_parallel_size=6), "5 experts")):
        with pytest.raises(ConfigError, match="'enable_expert_parallel'") as caught:
            LLM(model_dir, enable_expert_parallel=True, multiprocess=False, **extra)
        assert phrase in str(caught.value)


# -- the op --------------------------------------------------------------------------------------

def per_token_reference(layer: FusedMoE, hidden, weights, ids) -> torch.Tensor:
    """The plain loop over tokens and their experts."""
    inter = layer.intermediate_size_per_rank
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            gate_up = layer.gate_up_proj[expert] @ hidden[token]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[token] += weights[token, slot] * (layer.down_proj[expert] @ act)
    return out


@pytest.mark.parametrize("rows", [1, 4, 33])
def test_forward_native_equals_a_loop_over_tokens(rows):
    from sparrow.ops.moe_cases import fill_experts

    layer = FusedMoE(7, 32, 24)
    fill_experts(layer, torch.Generator().manual_seed(rows))
    gen = torch.Generator().manual_seed(100 + rows)
    hidden = torch.randn(rows, 32, generator=gen)
    logits = torch.randn(rows, 7, generator=gen)
    logits[:, 6] = -30.0  # an expert no token picks
    weights, ids = select_experts(logits, 3, renormalize=False)
    got = layer.forward_native(hidden, weights, ids)
    torch.testing.assert_close(got, per_token_reference(layer, hidden, weights, ids), atol=1e-5, rtol=1e-5)
    assert layer.forward_native(hidden[:0], weights[:0], ids[:0]).shape == (0, 32)


def test_routing_follows_transformers():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0, 0.5]])
    probs = logits.softmax(-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights, probs[:, [1, 2]])
    weights, _ = select_experts(logits.to(torch.bfloat16), 2, renormalize=True)
    assert weights.dtype == torch.float32 and torch.allclose(weights.sum(-1), torch.ones(1))


def test_bad_config_and_shards_are_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(16, 4, 5, 8, renormalize=True, weights_in_model_dtype=True)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        FusedMoE(4, 16, 9, tp=ParallelContext(0, 2))
    layer = FusedMoE(4, 16, 8)
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(8, 16), ("gate", 4))
    with pytest.raises(ValueError, match="down_proj"):
        layer.weight_loader(layer.down_proj, torch.zeros(8, 16), ("down", 0))
