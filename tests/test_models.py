"""Model code, weight loading and the CPU attention backend against Hugging Face transformers.

Every model is a random-weight "test" preset built in a temp directory by the tiny-model recipe;
transformers (eager attention, float32) loads the same directory and is the reference. The steps
are built by hand over a small paged cache with a block allocator, the way the model runner does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparrow.attention import AttentionMetadata
from sparrow.layers.parallel import ParallelContext
from sparrow.model_loader import WeightFileError, get_max_model_len, iter_safetensors, load_model
from sparrow.models.llama import MissingWeightsError
from sparrow.models.registry import UnsupportedArchitectureError
from sparrow.tiny.model import LLAMA3_ROPE_SCALING, build_model_dir
from sparrow_cpu.attention import TorchPagedAttention

BLOCK_SIZE = 16
NUM_BLOCKS = 160
PROMPT_LENS = (1, 7, 16, 17, 64, 300)
ATOL = 1e-4

VARIANTS = {
    # GQA with one KV head for four query heads, untied embeddings, Llama 3.1 rope scaling
    "llama": dict(arch="llama", num_key_value_heads=1, rope_scaling=LLAMA3_ROPE_SCALING),
    # tied embeddings, weights split over several safetensors files
    "llama-tied-sharded": dict(arch="llama", tie_word_embeddings=True, max_shard_size=40_000),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
}


# ------------------------------------------------------------------------------------------------
# Helpers: a paged cache with a block allocator, and steps built as the model runner builds them
# ------------------------------------------------------------------------------------------------


@dataclass
class PagedCache:
    kv_caches: list[torch.Tensor]
    block_size: int
    # Blocks are handed out from the top down, so a request's blocks are not contiguous.
    free_blocks: list[int]
    block_tables: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def for_model(cls, model, num_blocks: int = NUM_BLOCKS, dtype=torch.float32) -> "PagedCache":
        num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
        caches = [torch.zeros(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype)
                  for _ in range(num_layers)]
        return cls(caches, BLOCK_SIZE, list(range(num_blocks)))

    def reserve(self, req_id: str, num_tokens: int) -> list[int]:
        table = self.block_tables.setdefault(req_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free_blocks.pop())
        return table

    def share_prefix(self, req_id: str, source_id: str, num_blocks: int) -> None:
        self.block_tables[req_id] = list(self.block_tables[source_id][:num_blocks])


@dataclass
class Work:
    """One request's part of a step: its new tokens, after num_computed cached ones."""

    req_id: str
    new_token_ids: list[int]
    num_computed: int


def build_step(cache: PagedCache, works: list[Work], num_padding: int = 0):
    """(input_ids, positions, metadata) of one flat step; padding rows get slot -1."""
    input_ids, positions, slots, query_start_loc, seq_lens, tables = [], [], [], [0], [], []
    for work in works:
        seq_len = work.num_computed + len(work.new_token_ids)
        table = cache.reserve(work.req_id, seq_len)
        for offset, token_id in enumerate(work.new_token_ids):
            position = work.num_computed + offset
            input_ids.append(token_id)
            positions.append(position)
            slots.append(table[position // cache.block_size] * cache.block_size + position % cache.block_size)
        query_start_loc.append(len(input_ids))
        seq_lens.append(seq_len)
        tables.append(table)
    num_actual = len(input_ids)
    input_ids += [0] * num_padding
    positions += [0] * num_padding
    slots += [-1] * num_padding
    max_blocks = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    query_lens = [len(w.new_token_ids) for w in works]
    metadata = AttentionMetadata(
        num_actual_tokens=num_actual, num_reqs=len(works), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        is_decode_only=all(n == 1 for n in query_lens),
    )
    return torch.tensor(input_ids), torch.tensor(positions), metadata


@torch.inference_mode()
def run_step(model, cache: PagedCache, works: list[Work], num_padding: int = 0,
             prepare: bool = True) -> dict[str, torch.Tensor]:
    """req_id -> log-probs [num_new_tokens, vocab] of each of its new tokens."""
    input_ids, positions, metadata = build_step(cache, works, num_padding)
    if prepare:
        model.attn_backend.prepare(metadata)
    hidden = model.forward(input_ids, positions, cache.kv_caches, metadata)
    assert hidden.shape == (input_ids.shape[0], model.config.hidden_size)
    logprobs = torch.log_softmax(model.compute_logits(hidden[: metadata.num_actual_tokens]), dim=-1)
    out, start = {}, 0
    for work in works:
        out[work.req_id] = logprobs[start: start + len(work.new_token_ids)]
        start += len(work.new_token_ids)
    return out


@torch.inference_mode()
def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    # [len(token_ids), vocab] float32
    logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def prompts_for(vocab_size: int, lens=PROMPT_LENS, seed: int = 1) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {f"r{n}": torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lens}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL) -> None:
    error = (actual - expected).abs().max().item()
    assert error <= atol, f"{what}: max |log-prob difference| {error:.2e} > {atol:.0e}"


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """The models are tiny: one thread is faster than two contending OpenMP threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, model dir, sparrow model fp32, HF model fp32)."""
    from transformers import AutoModelForCausalLM

    name = request.param
    model_dir = build_model_dir(tmp_path_factory.mktemp(name), preset="test", with_tokenizer=False,
                                **VARIANTS[name])
    model = load_model(model_dir, TorchPagedAttention, torch.float32, "cpu")
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    return name, model_dir, model, hf_model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("qwen3-loader"), "qwen3", "test", with_tokenizer=False)


# ------------------------------------------------------------------------------------------------
# Logits against transformers
# ------------------------------------------------------------------------------------------------


def test_one_flat_batch_matches_hf(variant):
    name, _, model, hf_model = variant
    prompts = prompts_for(model.vocab_size)
    cache = PagedCache.for_model(model)
    got = run_step(model, cache, [Work(rid, ids, 0) for rid, ids in prompts.items()], num_padding=3)
    for rid, ids in prompts.items():
        assert_close(got[rid], hf_logprobs(hf_model, ids), f"{name} {rid}")


def test_chunked_prefill_matches_hf(variant):
    name, _, model, hf_model = variant
    prompts = prompts_for(model.vocab_size, seed=2)
    cache = PagedCache.for_model(model)
    computed = dict.fromkeys(prompts, 0)
    pieces: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    while any(computed[rid] < len(ids) for rid, ids in prompts.items()):
        works = [Work(rid, ids[computed[rid]: computed[rid] + 16], computed[rid])
                 for rid, ids in prompts.items() if computed[rid] < len(ids)]
        for rid, logprobs in run_step(model, cache, works, prepare=False).items():
            pieces[rid].append(logprobs)
        for work in works:
            computed[work.req_id] += len(work.new_token_ids)
    for rid, ids in prompts.items():
        assert_close(torch.cat(pieces[rid]), hf_logprobs(hf_model, ids), f"{name} chunked {rid}")


def test_decode_steps_match_hf_greedy(variant):
    name, _, model, hf_model = variant
    prompts = prompts_for(model.vocab_size, lens=(5, 33, 120), seed=3)
    late = prompts_for(model.vocab_size, lens=(40,), seed=4)  # joins while the others decode
    cache = PagedCache.for_model(model)
    sequences = {rid: list(ids) for rid, ids in prompts.items()}
    step_logprobs: dict[str, list[torch.Tensor]] = {rid: [] for rid in [*prompts, *late]}

    def greedy(rid: str, logprobs: torch.Tensor) -> None:
        step_logprobs[rid].append(logprobs[-1:])
        sequences[rid].append(int(logprobs[-1].argmax()))

    for rid, logprobs in run_step(model, cache, [Work(r, ids, 0) for r, ids in prompts.items()]).items():
        greedy(rid, logprobs)
    for step in range(6):
        works = [Work(rid, seq[-1:], len(seq) - 1) for rid, seq in sequences.items()]
        if step == 2:  # one batch mixes a prefill chunk with the decodes
            (late_id, late_ids), = late.items()
            works.insert(1, Work(late_id, late_ids, 0))
            sequences[late_id] = list(late_ids)
        for rid, logprobs in run_step(model, cache, works).items():
            greedy(rid, logprobs)
    for rid, seq in sequences.items():
        # HF sees the whole sequence at once; its logits at the last prompt position and after
        # each fed token are what the engine computed step by step.
        expected = hf_logprobs(hf_model, seq[:-1])
        got = torch.cat(step_logprobs[rid])
        assert_close(got, expected[-got.shape[0]:], f"{name} decode {rid}")


def test_prefix_cache_hit_starts_at_context_offset(variant):
    name, _, model, hf_model = variant
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, model.vocab_size, (40,), generator=generator).tolist()
    first = shared + torch.randint(0, model.vocab_size, (10,), generator=generator).tolist()
    second = shared[:32] + torch.randint(0, model.vocab_size, (25,), generator=generator).tolist()
    cache = PagedCache.for_model(model)
    run_step(model, cache, [Work("first", first, 0)])
    cache.share_prefix("second", "first", num_blocks=2)  # 32 tokens of cached prefix
    got = run_step(model, cache, [Work("second", second[32:], 32), Work("first", [7], len(first))])
    assert_close(got["second"], hf_logprobs(hf_model, second)[32:], f"{name} prefix hit")
    assert_close(got["first"], hf_logprobs(hf_model, first + [7])[-1:], f"{name} decode beside hit")


def test_bfloat16_runs_and_is_close(variant):
    name, model_dir, _, hf_model = variant
    model = load_model(model_dir, TorchPagedAttention, torch.bfloat16, "cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompts = prompts_for(model.vocab_size, lens=(3, 50, 130), seed=6)
    cache = PagedCache.for_model(model, dtype=torch.bfloat16)
    computed = dict.fromkeys(prompts, 0)
    pieces: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    for _ in range(2):  # a first chunk of 64 tokens, then the rest from the paged cache
        works = [Work(rid, ids[computed[rid]: computed[rid] + 64], computed[rid])
                 for rid, ids in prompts.items() if computed[rid] < len(ids)]
        for rid, logprobs in run_step(model, cache, works).items():
            pieces[rid].append(logprobs)
            computed[rid] += logprobs.shape[0]
    got = torch.cat([torch.cat(pieces[rid]) for rid in prompts])
    expected = torch.cat([hf_logprobs(hf_model, ids[: computed[rid]]) for rid, ids in prompts.items()])
    assert torch.isfinite(got).all()
    # Random logits of std ~4 over 4096 tokens have near-ties, so greedy agreement is pooled.
    total_variation = 0.5 * (got.exp() - expected.exp()).abs().sum(-1).max().item()
    assert total_variation < 0.15, f"{name} bf16: total variation {total_variation:.3f}"
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement > 0.85, f"{name} bf16: greedy agreement {agreement:.2f}"


# ------------------------------------------------------------------------------------------------
# Loading errors, registry, tensor-parallel sharding, the recipe
# ------------------------------------------------------------------------------------------------


def test_missing_tensor_is_named(qwen3_dir, tmp_path):
    weights = load_file(str(qwen3_dir / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((qwen3_dir / "config.json").read_text())
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(broken, TorchPagedAttention, torch.float32, "cpu")


def test_missing_shard_file_is_named(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", "qwen3", "test", with_tokenizer=False, max_shard_size=60_000)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    (model_dir / files[1]).unlink()
    with pytest.raises(WeightFileError, match=files[1]):
        load_model(model_dir, TorchPagedAttention, torch.float32, "cpu")


def test_partial_shard_file_names_absent_tensor(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", "qwen3", "test", with_tokenizer=False, max_shard_size=60_000)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    victim = "model.norm.weight"
    path = model_dir / index["weight_map"][victim]
    tensors = load_file(str(path))
    del tensors[victim]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(WeightFileError, match=r"model\.norm\.weight"):
        load_model(model_dir, TorchPagedAttention, torch.float32, "cpu")


def test_unknown_architecture_lists_supported(qwen3_dir, tmp_path):
    config = json.loads((qwen3_dir / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    model_dir = tmp_path / "foo"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as excinfo:
        load_model(model_dir, TorchPagedAttention, torch.float32, "cpu")
    message = str(excinfo.value)
    assert "FooForCausalLM" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_shards_slice_the_full_weights(qwen3_dir, world_size):
    """Each rank loads (through lazy safetensors slices) exactly its heads and rows."""
    full = load_model(qwen3_dir, TorchPagedAttention, torch.float32, "cpu")
    attn = full.model.layers[0].self_attn
    q_full, k_full, v_full = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    head_dim, total_kv = attn.head_dim, attn.num_kv_heads
    for rank in range(world_size):
        tp = ParallelContext(rank=rank, world_size=world_size)
        model = type(full)(full.config, TorchPagedAttention, torch.float32, "cpu", tp)
        model.load_weights(iter_safetensors(qwen3_dir, tp))
        part = model.model.layers[0].self_attn
        q, k, v = part.qkv_proj.weight.split([part.q_size, part.kv_size, part.kv_size])
        torch.testing.assert_close(q, q_full.chunk(world_size)[rank], rtol=0, atol=0)
        kv_rank = rank // max(1, world_size // total_kv)
        kv_rows = slice(kv_rank * part.kv_size, (kv_rank + 1) * part.kv_size)
        torch.testing.assert_close(k, k_full[kv_rows], rtol=0, atol=0)
        torch.testing.assert_close(v, v_full[kv_rows], rtol=0, atol=0)
        assert model.kv_cache_spec() == (2, max(1, total_kv // world_size), head_dim)
        down = model.model.layers[1].mlp.down_proj.weight
        torch.testing.assert_close(down, full.model.layers[1].mlp.down_proj.weight.chunk(world_size, 1)[rank])
        embed = model.model.embed_tokens.weight
        torch.testing.assert_close(embed, full.model.embed_tokens.weight.chunk(world_size)[rank])


def test_recipe_is_deterministic_and_context_is_not_cut_to_the_window(tmp_path):
    first = build_model_dir(tmp_path / "a", "llama", "test", seed=3, with_tokenizer=False)
    second = build_model_dir(tmp_path / "b", "llama", "test", seed=3, with_tokenizer=False)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    other = build_model_dir(tmp_path / "c", "llama", "test", seed=4, with_tokenizer=False)
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(first), local_files_only=True)
    assert get_max_model_len(config) == 2048
    config.sliding_window = 512  # attended through the window, not cut to it
    assert get_max_model_len(config) == 2048


def _tensor_parallel_worker(rank: int, world_size: int, init_file: str, model_dir: str, result_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=world_size)
    try:
        torch.set_num_threads(1)
        tp = ParallelContext(rank=rank, world_size=world_size)
        model = load_model(model_dir, TorchPagedAttention, torch.float32, "cpu", tp=tp)
        prompts = prompts_for(model.vocab_size, lens=(9, 40), seed=7)
        cache = PagedCache.for_model(model)
        got = run_step(model, cache, [Work(rid, ids, 0) for rid, ids in prompts.items()])
        got.update({f"{rid}-decode": lp for rid, lp in run_step(
            model, cache, [Work(rid, [3], len(ids)) for rid, ids in prompts.items()]).items()})
        torch.save(got, f"{result_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_tensor_parallel_forward_matches_single_device(tmp_path):
    """Two gloo ranks (column/row-parallel linears, sharded KV heads and vocabulary) give the
    logits of one device."""
    model_dir = build_model_dir(tmp_path / "m", "qwen3", "test", with_tokenizer=False)
    torch.multiprocessing.spawn(
        _tensor_parallel_worker, args=(2, str(tmp_path / "init"), str(model_dir), str(tmp_path)),
        nprocs=2, join=True,
    )
    model = load_model(model_dir, TorchPagedAttention, torch.float32, "cpu")
    prompts = prompts_for(model.vocab_size, lens=(9, 40), seed=7)
    cache = PagedCache.for_model(model)
    expected = run_step(model, cache, [Work(rid, ids, 0) for rid, ids in prompts.items()])
    expected.update({f"{rid}-decode": lp for rid, lp in run_step(
        model, cache, [Work(rid, [3], len(ids)) for rid, ids in prompts.items()]).items()})
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, logprobs in expected.items():
            assert_close(got[key], logprobs, f"tp rank {rank} {key}")


def test_builtin_model_is_built_once_into_the_cache(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sparrow.tiny.model as recipe

    monkeypatch.setenv("SPARROW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(recipe.BUILTIN_MODELS, "sparrow-test", dict(arch="qwen3", preset="test", seed=0))
    path = recipe.get_builtin_model_path("sparrow-test")
    assert path == tmp_path / "cache" / "models" / "sparrow-test"
    assert sorted(p.name for p in path.parent.iterdir()) == ["sparrow-test"]  # no staging left
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert recipe.get_builtin_model_path("sparrow-test") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    hf_model = AutoModelForCausalLM.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert hf_model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert hf_model.generation_config.eos_token_id[0] == hf_model.config.eos_token_id
    with pytest.raises(ValueError, match="sparrow-tiny"):
        recipe.get_builtin_model_path("no-such-model")
