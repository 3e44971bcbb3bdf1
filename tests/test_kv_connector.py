"""Disaggregated prefill through the shared-storage KV connector, on a real model."""

from __future__ import annotations

import random

import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError


def prompts_for(vocab_size: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(0, vocab_size - 8) for _ in range(n)] for n in (40, 65, 130, 17)]


def run(model_dir, prompts, max_tokens, **engine_args):
    llm = LLM(model_dir, multiprocess=False, dtype="float32", max_model_len=512, **engine_args)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()


def test_consumer_loads_the_producers_prefill_and_matches_a_single_engine(qwen3_dir, tmp_path):
    prompts = prompts_for(4096)
    expected = run(qwen3_dir, prompts, 6, enable_prefix_caching=False)
    storage = {"storage_path": str(tmp_path / "kv")}

    # Engine A prefills (one token each) and saves every full prompt block.
    run(qwen3_dir, prompts, 1, kv_connector="shared_storage", kv_role="kv_producer",
        kv_connector_extra_config=storage)
    saved = list((tmp_path / "kv").glob("*.safetensors"))
    assert len(saved) == sum(len(p) // 16 for p in prompts)

    # Engine B loads them instead of computing them.
    llm = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=512, enable_prefix_caching=False,
              kv_connector="shared_storage", kv_role="kv_consumer", kv_connector_extra_config=storage)
    loaded = 0
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for p in prompts:
            llm.llm_engine.add_request(str(len(p)), {"prompt_token_ids": p}, params)
        outputs = {}
        while llm.llm_engine.has_unfinished_requests():
            for out in llm.llm_engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
            loaded = llm.llm_engine.last_stats.kv_connector_loaded_tokens  # cumulative
    finally:
        llm.shutdown()
    # Every full prompt block except the one holding the last prompt token came from storage.
    assert loaded == sum(((len(p) - 1) // 16) * 16 for p in prompts)
    assert [outputs[str(len(p))] for p in prompts] == expected


def test_unknown_connector_and_missing_role_are_clear_errors(qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown kv_connector 'nope'.*shared_storage"):
        LLM(qwen3_dir, multiprocess=False, max_model_len=128, kv_connector="nope", kv_role="kv_both")
    with pytest.raises(ValueError, match="kv_role.*must be set"):
        LLM(qwen3_dir, multiprocess=False, max_model_len=128, kv_connector="shared_storage",
            kv_connector_extra_config={"storage_path": str(tmp_path)})
    with pytest.raises(ConfigError, match="kv_role"):
        LLM(qwen3_dir, multiprocess=False, kv_role="sideways")
