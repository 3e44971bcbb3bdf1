"""Speculative decoding with a draft model: configuration checks, and the engine's output with a
draft against the same engine without one (small test model, real engine, chunked prefill,
prefix caching and preemption forced)."""

from __future__ import annotations

import collections
import json
import shutil

import numpy as np
import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError, EngineConfig
from sparrow.engine.setup import finalize_config
from sparrow.spec_decode.draft_model import DraftStep, PagedDraftCache, greedy
from sparrow.tiny.draft import build_draft_dir
from sparrow.wire import SchedulerStats

# Small step budget (chunked prefill, and draft catch-ups longer than a step), a cache small
# enough to force preemption, prefix caching on.
ENGINE = dict(multiprocess=False, max_num_batched_tokens=48, num_kv_blocks=24, enable_prefix_caching=True)
TEXT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat. "
PROMPTS = [TEXT * 3, "Once upon a time there was", "def add(a, b):\n    return a + b\n" * 3,
           "1 2 3 4 5 6 7 8 9 10 11 12", TEXT * 2 + "hello", "In a distant galaxy"]
GREEDY = SamplingParams(max_tokens=48, temperature=0)


def draft_config(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def small_draft_dir(qwen3_dir, tmp_path_factory) -> str:
    # The target's first layer: the same vocabulary, a cheaper model that agrees with it sometimes.
    return str(build_draft_dir(qwen3_dir, tmp_path_factory.mktemp("draft") / "one-layer", num_layers=1))


@pytest.fixture(scope="module")
def engines(qwen3_dir, small_draft_dir):
    base = LLM(qwen3_dir, **ENGINE)
    # The target as its own draft: every draft should be accepted, a strong check of the draft's
    # own KV bookkeeping (catch-up, rollback after rejections, preemption).
    same = LLM(qwen3_dir, speculative_config=draft_config(qwen3_dir), **ENGINE)
    small = LLM(qwen3_dir, speculative_config=draft_config(small_draft_dir, k=3), **ENGINE)
    yield base, same, small
    for llm in (base, same, small):
        llm.llm_engine.shutdown()


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def spec_counts(llm, before: SchedulerStats) -> tuple[int, int]:
    stats = llm.llm_engine.last_stats
    return (stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)


def assert_no_block_leak(llm) -> None:
    proposer = runner_of(llm).proposer
    pool = proposer.pool
    held = collections.Counter(block for req in proposer.requests.values() for block in req.block_ids)
    refs = {block.block_id: block.ref_cnt for block in pool.blocks if block.ref_cnt}
    assert dict(held) == refs  # every hold counted, nothing else
    # Only indexed blocks are shared.
    assert all(pool.blocks[block].block_hash is not None for block, count in held.items() if count > 1)
    assert len(held) + pool.get_num_free_blocks() == pool.num_blocks == proposer.cache.kv_caches[0].shape[1]
    assert set(proposer.requests) <= set(runner_of(llm).batch.req_id_to_row)


# -- configuration ---------------------------------------------------------------------------------
def test_bad_draft_configs_name_the_field(tmp_path):
    (tmp_path / "no-config").mkdir()
    (tmp_path / "alien").mkdir()
    (tmp_path / "alien" / "config.json").write_text(json.dumps({"architectures": ["NopeForCausalLM"]}))
    cases = [({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is required"),
             (draft_config(str(tmp_path / "missing")), "speculative_config.model: .* is not a directory"),
             (draft_config(str(tmp_path / "no-config")), "speculative_config.model: .* has no config.json"),
             (draft_config(str(tmp_path / "alien")), r"speculative_config.model: .*\['NopeForCausalLM'\] are not")]
    for value, message in cases:
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(speculative_config=value)


def test_draft_must_share_the_vocabulary(qwen3_dir, small_draft_dir, tmp_path):
    wider = tmp_path / "wider"
    shutil.copytree(small_draft_dir, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    with pytest.raises(ConfigError, match=r"speculative_config.model: .* has vocab_size 4160, the target model 4096"):
        finalize_config(EngineConfig.from_kwargs(model=qwen3_dir, speculative_config=draft_config(str(wider))))

    # Same size, another tokenizer: two tokens swap ids.
    other = tmp_path / "other-tokenizer"
    shutil.copytree(small_draft_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match=r"speculative_config.model: the tokenizer of .* differs"):
        finalize_config(EngineConfig.from_kwargs(model=qwen3_dir, speculative_config=draft_config(str(other))))

    # A draft that fits passes, its path made absolute.
    config = finalize_config(EngineConfig.from_kwargs(model=qwen3_dir,
                                                      speculative_config=draft_config(small_draft_dir)))
    assert config.speculative.speculative_config["model"] == str(small_draft_dir)


def test_a_draft_the_ranks_cannot_split_is_refused_before_anything_starts(qwen3_dir, small_draft_dir, tmp_path):
    odd = tmp_path / "odd-heads"
    shutil.copytree(small_draft_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3, "num_key_value_heads": 3}))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size.*does not divide the draft model.s 3 attention heads"):
        finalize_config(EngineConfig.from_kwargs(model=qwen3_dir, tensor_parallel_size=2,
                                                 speculative_config=draft_config(str(odd))))
    # The same draft at one rank is fine.
    finalize_config(EngineConfig.from_kwargs(model=qwen3_dir, speculative_config=draft_config(str(odd))))


def test_build_draft_dir(qwen3_dir, small_draft_dir, tmp_path):
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(small_draft_dir).num_hidden_layers == 1
    with pytest.raises(ValueError, match="num_layers must be between 1 and the target's 2 layers"):
        build_draft_dir(qwen3_dir, tmp_path / "too-deep", num_layers=3)


# -- the engine ------------------------------------------------------------------------------------
def test_greedy_output_is_identical_with_a_draft_model(engines):
    base, same, small = engines
    expected = token_ids(base.generate(PROMPTS, GREEDY))
    for llm in (same, small):
        before = llm.llm_engine.last_stats or SchedulerStats()
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected  # prefixes from the prefix cache now
        drafted, accepted = spec_counts(llm, before)
        stats = llm.llm_engine.last_stats
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert stats.num_free_blocks == stats.num_total_blocks
        assert_no_block_leak(llm)
        if llm is same:
            # The target drafting for itself: the draft's KV matches the target's, so (up to
            # float rounding between batch shapes) every draft is accepted.
            assert accepted >= 0.95 * drafted > 0, (accepted, drafted)
        else:
            assert 0 < accepted < drafted


def test_shared_prefixes_share_draft_blocks_and_stay_exact(engines):
    """Ten copies of one prompt share the target's prefix-cached blocks, and the draft's too: each
    new request starts from the draft's cached blocks of the prompt (whole blocks before its last
    token) instead of computing and holding a copy of its own; the output stays exact."""
    base, same, _ = engines
    prompt_ids = same.get_tokenizer().encode(PROMPTS[0])
    expected = token_ids(base.generate([PROMPTS[0]], GREEDY)) * 10
    proposer = runner_of(same).proposer
    adopted: list[int] = []
    touch = proposer.pool.touch  # a new request takes its cached prefix blocks with one touch
    proposer.pool.touch = lambda blocks: adopted.append(len(blocks)) or touch(blocks)
    try:
        before = same.llm_engine.last_stats or SchedulerStats()
        assert token_ids(same.generate([PROMPTS[0]] * 10, GREEDY)) == expected
    finally:
        del proposer.pool.touch
    # The first copy computes the prompt's blocks, the others share them; a copy coming back
    # after a preemption also finds the blocks of its own output so far.
    prompt_blocks = (len(prompt_ids) - 1) // runner_of(same).block_size
    assert len(adopted) >= 10 and sum(1 for count in adopted if count >= prompt_blocks) >= 9, adopted
    drafted, accepted = spec_counts(same, before)
    assert accepted >= 0.95 * drafted > 0
    assert_no_block_leak(same)


def test_a_cache_salt_keys_the_drafts_own_prefix_cache_too(engines):
    """vLLM's cache_salt reaches the draft's cache: a new request adopts the draft blocks of
    requests with its salt only (none of the unsalted ones, none of another salt's), as the
    target's prefix cache does; the output stays exact."""
    base, same, _ = engines
    expected = token_ids(base.generate([PROMPTS[2]], GREEDY))
    proposer = runner_of(same).proposer
    adopted: list[int] = []
    touch = proposer.pool.touch
    proposer.pool.touch = lambda blocks: adopted.append(len(blocks)) or touch(blocks)
    try:
        largest = {}
        for label, salt in (("plain", None), ("a", "tenant-a"), ("b", "tenant-b"), ("a again", "tenant-a")):
            adopted.clear()
            prompt = {"prompt": PROMPTS[2], **({"cache_salt": salt} if salt else {})}
            outputs = same.generate([prompt], GREEDY)
            assert token_ids(outputs) == expected, label
            largest[label] = (max(adopted, default=0), outputs[0].num_cached_tokens)
    finally:
        del proposer.pool.touch
    assert largest["a"] == (0, 0) and largest["b"] == (0, 0), largest
    assert largest["a again"][0] >= 1 and largest["a again"][1] >= runner_of(same).block_size, largest
    assert_no_block_leak(same)


def test_rows_without_draft_blocks_go_without_drafts_and_stay_exact(engines):
    """With every draft block taken, rows get no drafts (counted in num_rows_without_room) and the
    output is the target's own; once the blocks are back, drafting resumes."""
    base, same, _ = engines
    expected = token_ids(base.generate(PROMPTS[:3], GREEDY))
    proposer = runner_of(same).proposer
    for req_id in list(proposer.requests):  # rows of the last call, released by the next propose
        proposer._release(req_id)
    taken = proposer.pool.get_new_blocks(proposer.pool.get_num_free_blocks())
    try:
        without_room = proposer.num_rows_without_room
        before = same.llm_engine.last_stats or SchedulerStats()
        assert token_ids(same.generate(PROMPTS[:3], GREEDY)) == expected
        assert proposer.num_rows_without_room > without_room
        assert spec_counts(same, before) == (0, 0)
    finally:
        proposer.pool.free_blocks(taken)
    before = same.llm_engine.last_stats
    assert token_ids(same.generate(PROMPTS[:3], GREEDY)) == expected
    drafted, accepted = spec_counts(same, before)
    assert accepted >= 0.95 * drafted > 0
    assert_no_block_leak(same)


def reference_drafts(proposer, tokens, k: int) -> list[int]:
    """The draft model's greedy continuation of ``tokens``, computed from scratch in a cache of
    its own (what the proposer's incremental bookkeeping must reproduce)."""
    runner, block_size = proposer.model_runner, proposer.block_size
    num_blocks = -(-(len(tokens) + k) // block_size)
    cache = PagedDraftCache(*proposer.model.kv_cache_spec(), block_size, runner.dtype, runner.device)
    cache.allocate(num_blocks)
    table = [list(range(num_blocks))]
    drafts: list[int] = []
    step = DraftStep(runner, block_size, [tokens], [0], table)
    for j in range(k):
        proposer.model.attn_backend.prepare(step.metadata)
        hidden = proposer.model.forward(step.input_ids, step.positions, cache.kv_caches, step.metadata)
        drafts.append(greedy(proposer.model, hidden, step.last)[0])
        step = DraftStep(runner, block_size, [np.array(drafts[-1:])], [len(tokens) + j], table)
    return drafts


def test_incremental_drafts_equal_drafts_from_scratch(engines, monkeypatch):
    """The small draft's drafts are often rejected: after every step, each row's drafts (from
    KV kept across steps, rolled back to the accepted tokens) equal the draft model's greedy
    continuation computed from scratch."""
    _, _, small = engines
    proposer = runner_of(small).proposer
    propose = proposer.propose
    checked = []

    def checking(rows, token_ids_, num_tokens, hidden_states=None):
        drafts = propose(rows, token_ids_, num_tokens, hidden_states)
        for row, row_drafts in zip(rows, drafts):
            expected = reference_drafts(proposer, token_ids_[row, : num_tokens[row]], len(row_drafts))
            checked.append(row_drafts == expected)
        return drafts

    monkeypatch.setattr(proposer, "propose", checking)
    before = small.llm_engine.last_stats or SchedulerStats()
    small.generate([f"note {i}: {prompt}" for i, prompt in enumerate(PROMPTS)], GREEDY)  # not prefix-cached
    drafted, accepted = spec_counts(small, before)
    assert 0 < accepted < drafted / 2  # mostly rejected: the rollback ran
    assert len(checked) > 100 and all(checked)


def test_seeded_requests_reproduce(engines):
    base, _, small = engines
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=8, top_p=0.95, seed=seed) for seed in range(8)]
    expected = token_ids(base.generate([PROMPTS[2]] * 8, params))
    assert token_ids(small.generate([PROMPTS[2]] * 8, params)) == expected
    assert token_ids(small.generate([PROMPTS[2]] * 8, params)) == expected
    assert len({tuple(tokens) for tokens in expected}) > 1


def test_draft_cache_shares_the_kv_budget(engines):
    base, same, small = engines
    for llm in (same, small):
        runner = runner_of(llm)
        proposer = runner.proposer
        # Sized like the target's cache plus the blocks each request's fed drafts may need past the
        # target's slots, and counted in the bytes the worker budgets.
        assert runner.kv_caches[0].shape[1] == ENGINE["num_kv_blocks"]
        ahead = -(-proposer.num_speculative_tokens // runner.block_size)
        assert proposer.cache.kv_caches[0].shape[1] == ENGINE["num_kv_blocks"] + min(
            runner.max_num_reqs, ENGINE["num_kv_blocks"]) * ahead
        assert runner.kv_cache_fixed_bytes() == proposer.cache.bytes_per_block * runner.max_num_reqs * ahead
        assert runner.kv_cache_bytes_per_block() == (runner_of(base).kv_cache_bytes_per_block()
                                                     + proposer.cache.bytes_per_block)
        assert len(proposer.cache.kv_caches) == proposer.model.kv_cache_spec()[0]
    assert runner_of(small).proposer.cache.bytes_per_block * 2 == runner_of(same).proposer.cache.bytes_per_block
