"""Speculative decoding (n-gram): configuration, proposer, rejection sampling, and the engine's
output with speculation against the same engine without it (tiny built-in model, real engine)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError, EngineConfig
from sparrow.engine.metrics import EngineMetrics, render
from sparrow.engine.stat_loggers import StatLoggerManager
from sparrow.hookspecs import hookimpl
from sparrow.plugins import PluginError, get_plugin_manager, get_registry, register_plugin
from sparrow.spec_decode.ngram import propose_ngram
from sparrow.spec_decode.proposer import SpecProposer
from sparrow.spec_decode.rejection_sampler import rejection_sample
from sparrow.wire import SchedulerStats

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Small step budget (chunked prefill), a cache small enough to force preemption, prefix caching on.
ENGINE = dict(multiprocess=False, max_num_batched_tokens=48, num_kv_blocks=24, enable_prefix_caching=True)
TEXT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat. "
PROMPTS = [TEXT * 3, "Once upon a time there was", "def add(a, b):\n    return a + b\n" * 3,
           "1 2 3 4 5 6 7 8 9 10 11 12", TEXT * 2 + "hello", "In a distant galaxy"]


@pytest.fixture(scope="module")
def engines(qwen3_dir):
    # The small test model (not the built-in benchmark model): the same engine paths, a fraction
    # of the time.
    base = LLM(qwen3_dir, **ENGINE)
    spec = LLM(qwen3_dir, speculative_config=SPEC, **ENGINE)
    yield base, spec
    base.llm_engine.shutdown()
    spec.llm_engine.shutdown()


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


# -- configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value, field", [
    ({"method": "nope", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "draft_model", "model": "/x", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "eagle", "model": "/x", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "medusa", "model": "/x", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "speculative_config.lookahead"),
])
def test_invalid_speculative_config_names_the_field(value, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        EngineConfig.from_kwargs(speculative_config=value)


def test_ngram_defaults_and_off_by_default():
    assert EngineConfig.from_kwargs().speculative.speculative_config is None
    config = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative.speculative_config["prompt_lookup_min"] == 5
    assert config.speculative.speculative_config["prompt_lookup_max"] == 5
    # The flat keywords round-trip (the engine's processes rebuild the config from them).
    assert EngineConfig.from_kwargs(**config.flat()).speculative == config.speculative


def test_cli_flag_takes_json():
    import argparse

    from sparrow.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}


def test_ngram_registers_through_the_hook():
    assert get_registry().spec_proposers["ngram"] == "sparrow.spec_decode.ngram:NgramProposer"


# -- the proposer and the rejection sampler ----------------------------------------------------------
@pytest.mark.parametrize("tokens, min_n, max_n, k, expected", [
    ([1, 2, 3, 9, 1, 2], 1, 3, 3, [3, 9, 1]),  # the 2-gram "1 2" occurred: copy what followed
    ([5, 1, 2, 3, 7, 2, 3, 8, 1, 2, 3], 1, 3, 2, [7, 2]),  # longest suffix "1 2 3" wins over "2 3"
    ([4, 2, 3, 7, 2, 3, 8, 2, 3], 1, 2, 2, [8, 2]),  # among equal n-grams, the latest occurrence
    ([1, 2, 3, 4], 1, 3, 3, []),  # nothing repeats
    ([1, 2, 9, 2], 2, 3, 3, []),  # "2" repeats but min_n is 2
    ([7, 7, 7], 1, 2, 4, [7, 7, 7, 7]),  # a loop continues past the context's end
    ([1, 2, 1, 2, 1], 1, 3, 5, [2, 1, 2, 1, 2]),
])
def test_propose_ngram(tokens, min_n, max_n, k, expected):
    assert propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k) == expected


def test_rejection_sample_keeps_the_target_distribution():
    """Drafts drawn from q, verified against p: the first output token must follow p. Statistic:
    total-variation distance between the empirical and the target distribution over 40,000
    draws, threshold 0.02 (the sampling noise is about 0.005 for 4 outcomes)."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    num = 40_000
    drafts = torch.multinomial(q, num, replacement=True, generator=generator)
    outputs = rejection_sample(p.expand(num, 4), drafts, q.expand(num, 4), [1] * num,
                               bonus_token_ids=torch.zeros(num, dtype=torch.int64), generator=generator)
    first = Counter(tokens[0] for tokens in outputs)
    empirical = torch.tensor([first[i] / num for i in range(4)], dtype=torch.float64)
    assert 0.5 * (empirical - p).abs().sum().item() < 0.02
    # Accepted drafts are followed by the bonus token, rejected ones end the list.
    assert all(len(tokens) in (1, 2) for tokens in outputs)


# -- the engine ----------------------------------------------------------------------------------------
def test_greedy_output_is_identical_with_speculation(engines):
    base, spec = engines
    params = SamplingParams(max_tokens=48, temperature=0)
    expected = token_ids(base.generate(PROMPTS, params))
    before = spec.llm_engine.last_stats or SchedulerStats()
    got = token_ids(spec.generate(PROMPTS, params))
    assert got == expected
    # Again: now the prompts' prefixes come from the prefix cache.
    assert token_ids(spec.generate(PROMPTS, params)) == expected
    stats = spec.llm_engine.last_stats
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert stats.num_preemptions > 0  # the small cache preempted requests
    assert stats.prefix_cache_hits > 0
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert stats.num_free_blocks == stats.num_total_blocks  # every block (drafts' too) came back


def test_stop_conditions_inside_a_draft(engines):
    base, spec = engines
    prompt = PROMPTS[2]  # its greedy output loops, so drafts run past the stop
    full = token_ids(base.generate([prompt], SamplingParams(max_tokens=48, temperature=0)))[0]
    stop_at = len(full) - 10
    cases = [SamplingParams(max_tokens=stop_at, temperature=0),
             SamplingParams(max_tokens=48, temperature=0, stop_token_ids=[full[stop_at]]),
             SamplingParams(max_tokens=48, temperature=0,
                            stop=[base.get_tokenizer().decode(full[stop_at : stop_at + 2])])]
    for params in cases:
        expected = base.generate([prompt], params)[0].outputs[0]
        got = spec.generate([prompt], params)[0].outputs[0]
        assert (list(got.token_ids), got.text, got.finish_reason) == (list(expected.token_ids), expected.text,
                                                                      expected.finish_reason)
    assert len(spec.generate([prompt], cases[0])[0].outputs[0].token_ids) == stop_at


def sampling_prompt(base) -> dict:
    # A context the model's own greedy continuation repeats, so that sampled tokens find n-grams.
    prompt_ids = base.get_tokenizer().encode(PROMPTS[2])
    greedy_params = SamplingParams(max_tokens=32, temperature=0)
    greedy = token_ids(base.generate([{"prompt_token_ids": prompt_ids}], greedy_params))[0]
    return {"prompt_token_ids": prompt_ids + greedy}


def test_seeded_requests_reproduce_the_unspeculated_tokens(engines):
    base, spec = engines
    prompt = sampling_prompt(base)
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=8, top_p=0.95, seed=seed) for seed in range(12)]
    expected = token_ids(base.generate([prompt] * 12, params))
    assert token_ids(spec.generate([prompt] * 12, params)) == expected
    assert token_ids(spec.generate([prompt] * 12, params)) == expected
    assert len({tuple(tokens) for tokens in expected}) > 1


def test_sampled_distribution_is_unchanged(engines):
    """Unseeded samples of the first 3 tokens with and without speculation. Statistic: Pearson's
    chi-square two-sample test over the joint outcomes (outcomes seen fewer than 10 times in both
    runs together pooled); threshold: p-value above 1e-3. The engines' generators are seeded, so
    the test is deterministic."""
    base, spec = engines
    prompt = sampling_prompt(base)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3)
    num = 600
    before = spec.llm_engine.last_stats or SchedulerStats()
    counts_base = Counter(tuple(t) for t in token_ids(base.generate([prompt] * num, params)))
    counts_spec = Counter(tuple(t) for t in token_ids(spec.generate([prompt] * num, params)))
    assert spec.llm_engine.last_stats.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    outcomes = [o for o in set(counts_base) | set(counts_spec) if counts_base[o] + counts_spec[o] >= 10]
    rows = [(counts_base[o], counts_spec[o]) for o in outcomes]
    rows.append((num - sum(r[0] for r in rows), num - sum(r[1] for r in rows)))
    rows = [r for r in rows if sum(r) > 0]
    assert len(rows) >= 3
    chi2 = sum((a - b) ** 2 / (a + b) for a, b in rows)  # equal sample sizes
    dof = len(rows) - 1
    assert chi_square_survival(chi2, dof) > 1e-3, (chi2, dof, rows)


def chi_square_survival(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): 1 - P(dof / 2, x / 2), the regularised lower incomplete
    gamma function by its power series (no scipy here)."""
    a, half = dof / 2.0, x / 2.0
    if half <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-15 * total:
        n += 1
        term *= half / (a + n)
        total += term
    lower = math.exp(a * math.log(half) - half - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def test_metrics_use_vllm_names():
    metrics = EngineMetrics("m")
    manager = StatLoggerManager([metrics], interval=10.0)
    stats = SchedulerStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12,
                           spec_decode_num_accepted_tokens=5, spec_decode_num_accepted_tokens_per_pos=[3, 2, 0, 0])
    manager.record(stats, None)
    manager.record(stats, None)  # a snapshot seen twice counts once
    text = render(metrics).decode()
    assert 'sparrow:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'sparrow:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'sparrow:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert 'sparrow:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    assert not math.isnan(stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens)


# -- the proposer hook -----------------------------------------------------------------------------------
class RepeatLastProposer(SpecProposer):
    """Guesses that the last token repeats k times (a throwaway plugin proposer)."""

    def propose(self, rows, token_ids, num_tokens, hidden_states=None):
        return [[int(token_ids[row, num_tokens[row] - 1])] * self.num_speculative_tokens for row in rows]


class RepeatLastPlugin:
    @hookimpl
    def sparrow_register_spec_proposers(self, register):
        register("repeat_last", RepeatLastProposer)


class ClashingPlugin:
    @hookimpl
    def sparrow_register_spec_proposers(self, register):
        register("ngram", RepeatLastProposer)


def test_sparrow_register_spec_proposers(engines, qwen3_dir):
    base, _ = engines
    pm = get_plugin_manager()
    register_plugin(pm, RepeatLastPlugin(), "repeat-last-plugin")
    try:
        assert get_registry().spec_proposers["repeat_last"] is RepeatLastProposer
        llm = LLM(qwen3_dir, speculative_config={"method": "repeat_last", "num_speculative_tokens": 3}, **ENGINE)
        try:
            params = SamplingParams(max_tokens=32, temperature=0)
            assert token_ids(llm.generate(PROMPTS[:3], params)) == token_ids(base.generate(PROMPTS[:3], params))
            assert llm.llm_engine.last_stats.spec_decode_num_draft_tokens > 0
        finally:
            llm.llm_engine.shutdown()
        register_plugin(pm, ClashingPlugin(), "clashing-plugin")
        try:
            with pytest.raises(PluginError, match="'ngram' is registered by both"):
                get_registry()
        finally:
            pm.unregister(name="clashing-plugin")
    finally:
        pm.unregister(name="repeat-last-plugin")
    with pytest.raises(ConfigError, match=r"speculative_config\.method 'repeat_last' is unknown"):
        EngineConfig.from_kwargs(speculative_config={"method": "repeat_last", "num_speculative_tokens": 3})
