"""vLLM's ``logprobs_mode``: what a sampled token's logprobs report.

The reference is HF transformers on the same directory, teacher-forced over the prompt and the
engine's own output: its logits at every position that produced an output token. ``raw_logits``
reports those logits, ``raw_logprobs`` (the default) their log-softmax; ``processed_logprobs`` and
``processed_logits`` what the token was drawn from: the logits over the temperature with top-k's
filtered tokens at -inf (a greedy row beside it: its plain logits), normalized or not.
"""

from __future__ import annotations

import math

import pytest
import torch

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hf_logits(qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True).eval()

    def logits(output_ids: list[int]) -> torch.Tensor:
        """[len(output_ids), V]: the logits that produced each output token."""
        ids = PROMPT + output_ids[:-1]
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, len(PROMPT) - 1:].float()

    return logits


def reported(completion) -> list[tuple[float, dict[int, float]]]:
    """Per step: the sampled token's value and every reported token's."""
    return [(step[token].logprob, {tid: lp.logprob for tid, lp in step.items()})
            for token, step in zip(completion.token_ids, completion.logprobs)]


def test_raw_modes_report_the_models_logits_or_their_log_softmax(qwen3_dir, hf_logits):
    """Whatever the token was drawn with: a greedy step, and a step of random rows only (the
    temperature must not reach the reported values)."""
    from sparrow import LLM, SamplingParams

    for mode in ("raw_logits", "raw_logprobs"):
        with LLM(qwen3_dir, logprobs_mode=mode, multiprocess=False) as llm:
            for temperature in (0.0, 0.8):
                params = SamplingParams(temperature=temperature, seed=2, max_tokens=MAX_TOKENS, logprobs=3,
                                        ignore_eos=True)
                completion = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
                expected = hf_logits(list(completion.token_ids))
                if mode == "raw_logprobs":
                    expected = expected.log_softmax(dim=-1)
                for step, (token, (value, entries)) in enumerate(zip(completion.token_ids, reported(completion))):
                    where = (mode, temperature, step)
                    assert value == pytest.approx(float(expected[step, token]), abs=1e-4), where
                    top = expected[step].topk(3).indices.tolist()
                    assert set(top) <= set(entries), where
                    for tid in top:
                        assert entries[tid] == pytest.approx(float(expected[step, tid]), abs=1e-4), where


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_modes_report_what_the_token_was_drawn_from(qwen3_dir, hf_logits, mode):
    from sparrow import LLM, SamplingParams

    sampled = SamplingParams(temperature=0.7, top_k=3, seed=4, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    with LLM(qwen3_dir, logprobs_mode=mode, multiprocess=False) as llm:
        outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [sampled, greedy], use_tqdm=False)
    random_row, greedy_row = (output.outputs[0] for output in outputs)

    logits = hf_logits(list(random_row.token_ids)) / 0.7
    kept = logits.topk(3, dim=-1).indices
    drawn_from = torch.full_like(logits, -math.inf).scatter(1, kept, logits.gather(1, kept))
    if mode == "processed_logprobs":
        drawn_from = drawn_from.log_softmax(dim=-1)
    for step, (token, (value, entries)) in enumerate(zip(random_row.token_ids, reported(random_row))):
        assert token in kept[step].tolist()
        assert value == pytest.approx(float(drawn_from[step, token]), abs=1e-4), step
        finite = {tid: lp for tid, lp in entries.items() if lp != -math.inf}
        assert set(finite) == set(kept[step].tolist()), step  # the other two entries are filtered out
        for tid, lp in finite.items():
            assert lp == pytest.approx(float(drawn_from[step, tid]), abs=1e-4), step
    # The greedy row beside it: its plain logits (no temperature, nothing filtered).
    plain = hf_logits(list(greedy_row.token_ids))
    if mode == "processed_logprobs":
        plain = plain.log_softmax(dim=-1)
    for step, (token, (value, _)) in enumerate(zip(greedy_row.token_ids, reported(greedy_row))):
        assert value == pytest.approx(float(plain[step, token]), abs=1e-4), step


def test_an_unknown_mode_is_refused_naming_it():
    from sparrow import LLM
    from sparrow.config import ConfigError

    with pytest.raises(ConfigError, match="logprobs_mode"):
        LLM(logprobs_mode="softmax", multiprocess=False)
