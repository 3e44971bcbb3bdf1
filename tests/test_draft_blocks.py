"""The draft model's cache on a real tiny model and draft: its extra blocks in the worker's KV
budget, its benchmark, and its own config. (Its block pool is sparrow.core.block_pool.BlockPool,
tested in test_block_pool.py; sharing between requests is tested in test_spec_draft.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparrow import LLM
from sparrow.tiny.draft import build_draft_dir


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
