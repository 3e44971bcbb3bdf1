"""The draft model's block pool (sparrow.spec_decode.draft_blocks): holds, sharing through chained
keys, caching after release, eviction of the oldest cached block; and the draft's extra blocks in
the worker's KV budget (real tiny model and draft)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparrow import LLM
from sparrow.spec_decode.draft_blocks import DraftBlockPool, chain_key
from sparrow.spec_decode.draft_model import PagedDraftCache
from sparrow.tiny.draft import build_draft_dir


def pool_of(num_blocks: int) -> DraftBlockPool:
    cache = PagedDraftCache(1, 1, 4, 4, torch.float32, torch.device("cpu"))
    cache.allocate(num_blocks)
    return DraftBlockPool(cache)


def keys_of(tokens: list[int], block_size: int = 4) -> list[bytes]:
    keys, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_key(parent, np.asarray(tokens[start : start + block_size]))
        keys.append(parent)
    return keys


def test_keys_name_the_whole_prefix():
    a, b = keys_of([1, 2, 3, 4, 5, 6, 7, 8]), keys_of([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different first: different keys
    assert keys_of([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # a partial block gets no key
    assert chain_key(None, np.asarray([1, 2, 3, 4], dtype=np.int32)) == a[0]  # the dtype does not matter


def test_indexed_blocks_are_shared_cached_and_evicted_oldest_first():
    pool = pool_of(4)
    first = [pool.take(), pool.take()]
    keys = keys_of([1, 2, 3, 4, 5, 6, 7, 8])
    for block, key in zip(first, keys):
        pool.register(block, key)
    shared = pool.match(keys)
    assert shared == first and pool.refs == {first[0]: 2, first[1]: 2}
    pool.release(first)
    assert pool.refs == {first[0]: 1, first[1]: 1} and pool.num_available() == 2
    pool.release(shared)
    assert not pool.refs and list(pool.cached) == [first[1], first[0]]  # released last block first
    assert pool.num_available() == 4
    # A later request finds the prefix again, and a miss stops the match.
    assert pool.match([keys[0], b"missing", keys[1]]) == [first[0]]
    pool.release([first[0]])
    # With no free block left, take evicts the oldest cached block and forgets its key.
    taken = [pool.take(), pool.take()]  # the two never-used blocks
    assert set(taken).isdisjoint(first)
    evicted = pool.take()
    assert evicted == first[1] and keys[1] not in pool.index and evicted not in pool.key_of
    assert pool.match(keys) == [first[0]]


def test_unindexed_blocks_and_duplicate_keys_go_back_to_the_free_list():
    pool = pool_of(2)
    a, b = pool.take(), pool.take()
    key = keys_of([1, 2, 3, 4])[0]
    pool.register(a, key)
    pool.register(b, key)  # same content computed twice: the first block keeps the entry
    assert pool.index == {key: a} and b not in pool.key_of
    pool.release([a, b])
    assert pool.cache.free == [b] and list(pool.cached) == [a]


@pytest.fixture(scope="module")
def small_draft_dir(qwen3_dir, tmp_path_factory) -> str:
    return str(build_draft_dir(qwen3_dir, tmp_path_factory.mktemp("draft") / "one-layer", num_layers=1))


def test_the_draft_blocks_beyond_the_targets_come_out_of_the_kv_budget(qwen3_dir, small_draft_dir):
    budget = 4 << 20
    config = {"method": "draft_model", "model": small_draft_dir, "num_speculative_tokens": 3}
    llm = LLM(qwen3_dir, speculative_config=config, multiprocess=False, kv_cache_memory_bytes=budget, max_num_seqs=8)
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        proposer = runner.proposer
        num_blocks = runner.kv_caches[0].shape[1]
        fixed = runner.kv_cache_fixed_bytes()
        assert fixed == proposer.cache.bytes_per_block * 8  # one block ahead (k <= block size) per request
        assert num_blocks == (budget - fixed) // runner.kv_cache_bytes_per_block()
        assert proposer.cache.kv_caches[0].shape[1] == num_blocks + 8
        used = sum(t.numel() * t.element_size() for t in runner.kv_caches) + sum(
            t.numel() * t.element_size() for t in proposer.cache.kv_caches)
        assert used <= budget
    finally:
        llm.shutdown()


def test_the_draft_cache_benchmark_runs_as_documented(qwen3_dir):
    """scripts/bench_draft_cache.py as docs/benchmarks.md runs it (smaller): every row drafts."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_draft_cache.py"
    result = subprocess.run([sys.executable, str(script), "--model", qwen3_dir, "--num-prompts", "6",
                             "--num-kv-blocks", "128"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("num_kv_blocks=128"))
    fields = dict(field.split("=") for field in line.split())
    assert fields["rows_without_room"] == "0" and int(fields["drafted"]) > 0


def test_the_targets_hf_overrides_do_not_reach_the_draft(qwen3_dir, small_draft_dir):
    import json as json_module

    own = json_module.loads((Path(small_draft_dir) / "config.json").read_text())["max_position_embeddings"]
    config = {"method": "draft_model", "model": small_draft_dir, "num_speculative_tokens": 2}
    llm = LLM(qwen3_dir, speculative_config=config, multiprocess=False, hf_overrides={"max_position_embeddings": 300},
              num_kv_blocks=32)
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        assert runner.model.config.max_position_embeddings == 300  # the target's override
        assert runner.proposer.model.config.max_position_embeddings == own != 300  # the draft's own config.json
    finally:
        llm.shutdown()
