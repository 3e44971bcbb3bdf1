"""vLLM's per-request ``SamplingParams.logprob_token_ids`` (the logprobs and ranks of chosen token
ids at every generated position, beside the sampled token's and the top ``logprobs`` when those
are set) and ``skip_reading_prefix_cache``.

Reference: HF transformers' log-softmax of its own logits at each greedy step (the same greedy
tokens), on the same directory, in fp32.
"""

from __future__ import annotations

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.errors import InvalidArgumentError

MAX_TOKENS = 8
PROMPT = [11, 402, 77, 1290, 3001, 58, 9]
REQUESTED = [5, 300, 17, 300]  # a duplicate: reported once


@pytest.fixture(scope="module")
def hf_steps(qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(PROMPT):].tolist(), [step[0].float().log_softmax(-1) for step in out.logits]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=128)
    yield engine
    engine.shutdown()


def test_the_requested_tokens_logprobs_and_ranks(llm, hf_steps):
    tokens, logprobs = hf_steps
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprob_token_ids=REQUESTED),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=2,
                             logprob_token_ids=REQUESTED),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS),  # beside one without
              # and one asking for fewer ids (the batch's lists have different lengths)
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprob_token_ids=[42])]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 4, params, use_tqdm=False)
    only_ids, with_top, plain, one_id = (output.outputs[0] for output in outputs)
    assert only_ids.token_ids == with_top.token_ids == plain.token_ids == one_id.token_ids == tokens
    assert plain.logprobs is None
    requested = list(dict.fromkeys(REQUESTED))
    for position, (token, reference) in enumerate(zip(tokens, logprobs)):
        top2 = reference.topk(2).indices.tolist()
        assert list(only_ids.logprobs[position]) == [token] + [t for t in requested if t != token]
        expected = list(dict.fromkeys([token, *top2, *requested]))
        assert sorted(with_top.logprobs[position]) == sorted(expected)
        assert list(one_id.logprobs[position]) == list(dict.fromkeys([token, 42]))
        for entries in (with_top.logprobs[position], one_id.logprobs[position]):
            for token_id, entry in entries.items():
                assert entry.logprob == pytest.approx(reference[token_id].item(), abs=1e-4)
                assert entry.rank == int((reference > reference[token_id]).sum()) + 1


def test_bad_ids_are_refused_naming_the_field(llm):
    for ids, words in [([4096], "outside the vocabulary"), (list(range(21)), "exceed the maximum of 20"),
                       ([], "at least one token id"), ([-1], "logprob_token_ids")]:
        with pytest.raises(InvalidArgumentError, match=words) as caught:
            llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, logprob_token_ids=ids),
                         use_tqdm=False)
        assert caught.value.field.startswith("logprob_token_ids")


def test_skip_reading_prefix_cache(llm):
    """vLLM's SamplingParams.skip_reading_prefix_cache: the whole prompt is computed again (the
    tokens do not change), where the same request without it reads its cached blocks."""
    prompt = {"prompt_token_ids": list(range(100, 180))}  # five full blocks of 16
    params = dict(temperature=0, max_tokens=4)
    first = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]
    cached = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]
    skipped = llm.generate(prompt, SamplingParams(skip_reading_prefix_cache=True, **params), use_tqdm=False)[0]
    assert cached.num_cached_tokens == 64 and skipped.num_cached_tokens == 0
    assert first.outputs[0].token_ids == cached.outputs[0].token_ids == skipped.outputs[0].token_ids
    with pytest.raises(InvalidArgumentError, match="skip_reading_prefix_cache cannot be False with prompt_logprobs"):
        SamplingParams(skip_reading_prefix_cache=False, prompt_logprobs=1)
