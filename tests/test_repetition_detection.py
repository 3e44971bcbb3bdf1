"""vLLM's ``SamplingParams.repetition_detection``: a request ends (finish_reason "repetition", stop
reason "repetition_detected") once its output ends with a pattern of min_pattern_size to
max_pattern_size tokens repeated min_count times.

The detector is checked against a brute-force reading of that definition on random and looping
sequences; the engine against HF transformers' greedy tokens for the same prompts, cut where the
brute force says the loop is complete (and left whole where it never is), with a repetition penalty
below 1 that makes the random-weight test model loop (HF's penalty is vLLM's); the server through
the openai client in test_server_flags.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.errors import InvalidArgumentError
from sparrow.sampling_options import RepetitionDetectionParams, ends_in_repetition


def first_repetition_end(tokens: list[int], max_size: int, min_size: int, count: int) -> int | None:
    """The shortest prefix length at which ``tokens`` end with a pattern repeated ``count`` times."""
    for end in range(1, len(tokens) + 1):
        for size in range(max(min_size, 1), max_size + 1):
            if size * count > end:
                continue
            tail = tokens[end - size * count:end]
            if all(tail[i * size:(i + 1) * size] == tail[:size] for i in range(count)):
                return end
    return None


def test_the_detector_agrees_with_the_definition():
    rng = random.Random(0)
    for trial in range(400):
        # Random sequences over a few symbols, some with a planted loop at the end.
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        if trial % 3 == 0:
            pattern = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            tokens += pattern * rng.randrange(2, 5)
        max_size, count = rng.randrange(1, 8), rng.randrange(2, 5)
        min_size = rng.randrange(0, max_size + 1)
        params = RepetitionDetectionParams(max_pattern_size=max_size, min_pattern_size=min_size, min_count=count)
        expected = first_repetition_end(tokens, max_size, min_size, count)
        # As the engine calls it: after every token, until the first hit.
        found = next((end for end in range(1, len(tokens) + 1) if ends_in_repetition(tokens[:end], params)), None)
        assert found == expected, (tokens, max_size, min_size, count)


def test_bad_parameters_name_the_field():
    for kwargs, field in [({"max_pattern_size": 4, "min_count": 1}, "repetition_detection.min_count"),
                          ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
                           "repetition_detection.min_pattern_size"),
                          ({"max_pattern_size": -1}, "repetition_detection.max_pattern_size"),
                          ({"max_pattern_size": 5000, "min_count": 2}, "repetition_detection.max_pattern_size"),
                          ({"max_pattern_size": 1024, "min_count": 100}, "repetition_detection.min_count")]:
        with pytest.raises(InvalidArgumentError) as caught:
            RepetitionDetectionParams(**kwargs)
        assert caught.value.field == field, kwargs
    with pytest.raises(InvalidArgumentError, match="has no field 'window'"):
        SamplingParams(repetition_detection={"window": 3})
    assert not RepetitionDetectionParams().enabled  # the default: off


@pytest.fixture(scope="module")
def prompts(qwen3_dir):
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(qwen3_dir).vocab_size
    rng = random.Random(3)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for length in (5, 17, 40, 9, 3, 25)]


@pytest.fixture(scope="module")
def hf_tokens(qwen3_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                               do_sample=False, pad_token_id=0, repetition_penalty=PENALTY)[0, len(prompt):].tolist()
                for prompt in prompts]


MAX_TOKENS = 60
PENALTY = 0.5  # below 1: repeated tokens are favoured, so the outputs loop
SETTINGS = [dict(max_pattern_size=6, min_count=2), dict(max_pattern_size=4, min_pattern_size=2, min_count=3),
            dict(max_pattern_size=12, min_pattern_size=5, min_count=2), dict(max_pattern_size=3, min_count=20)]


def test_the_engine_ends_a_loop_where_hf_greedy_completes_it(qwen3_dir, prompts, hf_tokens):
    llm = LLM(qwen3_dir, max_model_len=256, max_num_batched_tokens=32, block_size=8)
    try:
        fired = 0
        for setting in SETTINGS:
            # min_tokens, as HF's min_new_tokens, bans EOS (with ignore_eos EOS could be sampled).
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                    repetition_penalty=PENALTY,
                                    repetition_detection=RepetitionDetectionParams(**setting))
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for output, reference in zip(outputs, hf_tokens):
                completion = output.outputs[0]
                end = first_repetition_end(reference, setting["max_pattern_size"],
                                           setting.get("min_pattern_size", 0), setting["min_count"])
                if end is None:
                    assert completion.token_ids == reference and completion.finish_reason == "length"
                else:
                    fired += 1
                    assert completion.token_ids == reference[:end], setting
                    assert (completion.finish_reason, completion.stop_reason) == ("repetition", "repetition_detected")
        assert 3 <= fired < len(SETTINGS) * len(prompts), "the settings must fire on some outputs, not all"
        # A token forced by logit_bias repeats at once: ends after min_count tokens.
        forced = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logit_bias={7: 100.0},
                                repetition_detection={"max_pattern_size": 3, "min_count": 4})
        completion = llm.generate({"prompt_token_ids": prompts[0]}, forced, use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == [7] * 4 and completion.finish_reason == "repetition"
    finally:
        llm.shutdown()
