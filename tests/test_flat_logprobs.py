"""vLLM's ``SamplingParams(flat_logprobs=True)``: logprobs and prompt logprobs as a
``sparrow.logprobs.FlatLogprobs``, which reads as the list of ``{token_id: Logprob}`` it replaces.

Reference: HF transformers' log-softmax on the same directory, in fp32 (teacher-forced over the
prompt and the greedy tokens).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.errors import InvalidArgumentError
from sparrow.logprobs import FlatLogprobs, Logprob
from sparrow.sampling_params import RequestOutputKind

PROMPT = [11, 402, 77, 1290, 3001, 58, 9, 640]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hf_logprobs(qwen3_dir):
    """Greedy tokens and log-softmax rows [len(PROMPT) + MAX_TOKENS - 1, V] predicting positions 1..."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        tokens = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                do_sample=False, pad_token_id=0)[0].tolist()
        rows = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    return tokens[len(PROMPT):], rows


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=128)
    yield engine
    engine.shutdown()


def _check(entries, tokens, rows, first_row, top):
    for position, (token, entry) in enumerate(zip(tokens, entries)):
        row = rows[first_row + position]
        assert next(iter(entry)) == token  # the scored token first, then the top ones
        assert set(row.topk(top).indices.tolist()) <= set(entry)
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
            assert logprob.rank == int((row > row[token_id]).sum()) + 1
            assert isinstance(logprob.decoded_token, str)


def test_flat_logprobs_read_as_the_list_form_and_match_hf(llm, hf_logprobs):
    tokens, rows = hf_logprobs
    params = dict(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=3, prompt_logprobs=2)
    flat, listed = llm.generate([{"prompt_token_ids": PROMPT}] * 2,
                                [SamplingParams(**params, flat_logprobs=True), SamplingParams(**params)],
                                use_tqdm=False)
    sample, prompt = flat.outputs[0].logprobs, flat.prompt_logprobs
    assert isinstance(sample, FlatLogprobs) and isinstance(prompt, FlatLogprobs)
    assert isinstance(listed.outputs[0].logprobs, list)
    assert flat.outputs[0].token_ids == tokens
    assert len(sample) == MAX_TOKENS and len(prompt) == len(PROMPT)
    _check(sample, tokens, rows, len(PROMPT) - 1, 3)
    assert prompt[0] == {}  # the list form's None: nothing predicts the first prompt token
    _check(prompt[1:], PROMPT[1:], rows, 0, 2)
    assert sample == listed.outputs[0].logprobs and prompt == listed.prompt_logprobs
    assert flat.outputs[0].cumulative_logprob == pytest.approx(listed.outputs[0].cumulative_logprob)


def test_streamed_deltas_join_to_the_whole(qwen3_dir, hf_logprobs):
    from sparrow.engine.async_llm import AsyncLLM

    tokens, rows = hf_logprobs

    async def run():
        engine = AsyncLLM.from_engine_args(model=qwen3_dir, dtype="float32", max_model_len=128)
        try:
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=2, n=2,
                                    flat_logprobs=True, output_kind=RequestOutputKind.DELTA)
            parts: dict[int, list] = {0: [], 1: []}
            async for output in engine.generate({"prompt_token_ids": PROMPT}, params, request_id="flat"):
                for completion in output.outputs:
                    assert isinstance(completion.logprobs, FlatLogprobs)
                    parts[completion.index].append(completion.logprobs)
            return parts
        finally:
            engine.shutdown()

    parts = asyncio.run(run())
    for index in (0, 1):
        joined = sum(parts[index], FlatLogprobs())
        assert isinstance(joined, FlatLogprobs) and len(joined) == MAX_TOKENS
        _check(joined, tokens, rows, len(PROMPT) - 1, 2)


def test_the_container_behaves_as_a_sequence_of_dicts():
    positions = [None, {5: Logprob(-0.5, 1, "a"), 7: Logprob(-1.5, 2, "b")}, {9: Logprob(-0.1, 1, None)}]
    flat = FlatLogprobs(positions)
    assert len(flat) == 3 and list(flat) == [{}, positions[1], positions[2]]
    assert flat == positions and flat[-1] == positions[2]
    assert isinstance(flat[1:], FlatLogprobs) and flat[1:] == positions[1:] and flat[::2] == [None, positions[2]]
    assert [] + flat == flat and flat + positions[1:2] == positions + positions[1:2]
    assert (flat + flat)[3:] == positions
    flat.append_position([4, 4, 6], [-0.2, -0.2, -2.0], [1, 1, 3], ["x", "x", "y"])  # the sampled token repeated
    assert flat[3] == {4: Logprob(-0.2, 1, "x"), 6: Logprob(-2.0, 3, "y")}
    with pytest.raises(IndexError):
        flat[4]
    with pytest.raises(TypeError, match="integers or slices"):
        flat["1"]


def test_a_non_boolean_is_refused_naming_the_field():
    with pytest.raises(InvalidArgumentError) as caught:
        SamplingParams(logprobs=1, flat_logprobs="yes")
    assert caught.value.field == "flat_logprobs"
