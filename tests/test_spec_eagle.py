"""Speculative decoding with an EAGLE head: configuration checks, the head reading the right target
hidden states, and the engine's output with a head against the same engine without one (small
test model, locally built heads, chunked prefill, prefix caching and preemption forced)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError, EngineConfig
from sparrow.engine.setup import finalize_config
from sparrow.spec_decode.draft_model import DraftStep, PagedDraftCache
from sparrow.spec_decode.eagle import EAGLE_WINDOW
from sparrow.tiny.eagle import build_eagle_dir
from sparrow.wire import SchedulerStats

ENGINE = dict(multiprocess=False, max_num_batched_tokens=48, num_kv_blocks=24, enable_prefix_caching=True)
TEXT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat. "
PROMPTS = [TEXT * 3, "Once upon a time there was", "def add(a, b):\n    return a + b\n" * 3,
           "1 2 3 4 5 6 7 8 9 10 11 12", TEXT * 2 + "hello", "In a distant galaxy"]
GREEDY = SamplingParams(max_tokens=48, temperature=0)


def eagle_config(model: str, k: int = 3) -> dict:
    return {"method": "eagle", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def head_dirs(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle")
    copy = build_eagle_dir(qwen3_dir, root / "copy")
    # "echo": fc passes the hidden state through and the layer adds nothing (zero output
    # projections), so the head's logits are the target's own at that position: it must draft
    # the token the target just produced, exactly when it reads the right hidden state.
    echo = root / "echo"
    shutil.copytree(copy, echo)
    weights = load_file(str(echo / "model.safetensors"))
    hidden = weights["fc.weight"].shape[0]
    weights["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        weights[name] = torch.zeros_like(weights[name])
    del weights["norm.weight"]
    save_file(weights, str(echo / "model.safetensors"), metadata={"format": "pt"})
    return {"copy": str(copy), "echo": str(echo)}


@pytest.fixture(scope="module")
def engines(qwen3_dir, head_dirs):
    base = LLM(qwen3_dir, **ENGINE)
    copy = LLM(qwen3_dir, speculative_config=eagle_config(head_dirs["copy"]), **ENGINE)
    echo = LLM(qwen3_dir, speculative_config=eagle_config(head_dirs["echo"], k=2), **ENGINE)
    yield base, copy, echo
    for llm in (base, copy, echo):
        llm.llm_engine.shutdown()


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


# -- configuration ---------------------------------------------------------------------------------
def test_bad_eagle_configs_name_the_field(qwen3_dir, head_dirs, tmp_path):
    with pytest.raises(ConfigError, match="speculative_config.model is required for method 'eagle'"):
        EngineConfig.from_kwargs(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    # A whole model is not a head.
    with pytest.raises(ConfigError, match=r"speculative_config.model: the EAGLE head's architectures "
                                          r"\['Qwen3ForCausalLM'\] are not supported"):
        EngineConfig.from_kwargs(speculative_config=eagle_config(qwen3_dir))
    for field, value, message in [("hidden_size", 32, "has hidden_size 32, the target 64"),
                                  ("vocab_size", 100, "has vocab_size 100, the target model 4096")]:
        bad = tmp_path / field
        shutil.copytree(head_dirs["copy"], bad)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ConfigError, match=rf"speculative_config.model: .*{message}"):
            finalize_config(EngineConfig.from_kwargs(model=qwen3_dir, speculative_config=eagle_config(str(bad))))
    finalize_config(EngineConfig.from_kwargs(model=qwen3_dir, speculative_config=eagle_config(head_dirs["copy"])))


def test_build_eagle_dir_layout(head_dirs, qwen3_dir, tmp_path):
    weights = load_file(str(build_eagle_dir(qwen3_dir, tmp_path / "random", copy_target_layer=False)
                            / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 128)
    assert "layers.0.input_layernorm.weight" not in weights and "norm.weight" not in weights  # EAGLE-1
    copied = load_file(head_dirs["copy"] + "/model.safetensors")
    target = load_file(qwen3_dir + "/model.safetensors")
    assert torch.equal(copied["layers.0.self_attn.q_proj.weight"], target["model.layers.0.self_attn.q_proj.weight"])


# -- the engine ------------------------------------------------------------------------------------
def test_greedy_output_is_identical_with_an_eagle_head(engines):
    base, copy, echo = engines
    expected = token_ids(base.generate(PROMPTS, GREEDY))
    for llm in (copy, echo):
        before = llm.llm_engine.last_stats or SchedulerStats()
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected  # prefixes from the prefix cache now
        stats = llm.llm_engine.last_stats
        drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert stats.num_free_blocks == stats.num_total_blocks
        if llm is copy:
            assert 0 < accepted < drafted
        proposer = runner_of(llm).proposer
        assert set(proposer.windows) <= set(runner_of(llm).batch.req_id_to_row)
        assert all(window.features.shape[0] <= EAGLE_WINDOW for window in proposer.windows.values())


def test_the_head_reads_the_hidden_state_of_the_last_position(engines, monkeypatch):
    """With the echo head every draft must be the row's newest token: any other hidden state (a
    wrong row, a rejected draft's position, a stale step) gives another token."""
    base, _, echo = engines
    proposer = runner_of(echo).proposer
    propose = proposer.propose
    seen: list[tuple[list[int], int]] = []

    def recording(rows, token_ids_, num_tokens, hidden_states=None):
        drafts = propose(rows, token_ids_, num_tokens, hidden_states)
        seen.extend((list(d), int(token_ids_[row, num_tokens[row] - 1])) for row, d in zip(rows, drafts))
        return drafts

    monkeypatch.setattr(proposer, "propose", recording)
    assert token_ids(echo.generate(PROMPTS, GREEDY)) == token_ids(base.generate(PROMPTS, GREEDY))
    assert len(seen) > 100
    assert all(drafts == [last] * len(drafts) and drafts for drafts, last in seen)


def test_windows_hold_the_targets_hidden_states(engines, monkeypatch):
    """What the head attends over, gathered step by step from verification steps (accepted and
    rejected drafts), chunked prefills and preemptions, equals the target's hidden states
    recomputed over the request's whole sequence in one forward, after every step."""
    _, copy, _ = engines
    runner = runner_of(copy)
    proposer = runner.proposer
    propose = proposer.propose
    checked: list[tuple[int, int]] = []

    def checking(rows, token_ids_, num_tokens, hidden_states=None):
        drafts = propose(rows, token_ids_, num_tokens, hidden_states)
        for req_id, window in proposer.windows.items():
            end = window.start + window.features.shape[0]
            tokens = token_ids_[runner.batch.req_id_to_row[req_id], :end]
            cache = PagedDraftCache(*runner.model.kv_cache_spec(), runner.block_size, runner.dtype, runner.device)
            num_blocks = -(-end // runner.block_size)
            cache.allocate(num_blocks)
            step = DraftStep(runner, runner.block_size, [tokens], [0], [list(range(num_blocks))])
            runner.model.attn_backend.prepare(step.metadata)
            hidden = runner.model.forward(step.input_ids, step.positions, cache.kv_caches, step.metadata)
            torch.testing.assert_close(window.features, hidden[window.start : end], atol=1e-4, rtol=1e-4)
            checked.append((window.start, end))
        return drafts

    monkeypatch.setattr(proposer, "propose", checking)
    copy.generate([f"story {i}: {prompt}" for i, prompt in enumerate(PROMPTS)], GREEDY)  # not prefix-cached
    assert len(checked) > 100
    assert max(end - start for start, end in checked) == EAGLE_WINDOW  # windows filled up and slid
    assert any(start == 0 for start, _ in checked)


def test_seeded_requests_reproduce(engines):
    base, copy, _ = engines
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=8, top_p=0.95, seed=seed) for seed in range(8)]
    expected = token_ids(base.generate([PROMPTS[2]] * 8, params))
    assert token_ids(copy.generate([PROMPTS[2]] * 8, params)) == expected
    assert token_ids(copy.generate([PROMPTS[2]] * 8, params)) == expected
    assert len({tuple(tokens) for tokens in expected}) > 1
