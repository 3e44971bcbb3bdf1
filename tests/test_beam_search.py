"""LLM.beam_search (vLLM's offline beam search) against HF transformers on the same directory.

Where no candidate is an end-of-sequence token, vLLM's beam search and HF's
``generate(num_beams=k)`` keep the same beams (the best k of every beam's top 2k extensions), so
the k sequences and their order must equal HF's; each cumulative logprob must equal the sum of
HF's log-softmax over the generated tokens. End-of-sequence handling and the length penalty are
checked on a model whose EOS token is one the search meets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparrow import LLM
from sparrow.beam_search import BeamSearchOutput, beam_search_score
from sparrow.sampling_params import BeamSearchParams, SamplingParams

PROMPTS = ["The cat sat on the", "Once upon a time there", "1 2 3 4 5 6 7 8"]
MAX_MODEL_LEN = 64


def build(directory: Path, seed: int, eos_token_id: int | None = None) -> str:
    from sparrow.tiny.model import build_model_dir

    path = Path(build_model_dir(directory, "qwen3", "test", seed=seed))
    if eos_token_id is not None:
        config = json.loads((path / "generation_config.json").read_text())
        config["eos_token_id"] = [eos_token_id]
        (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build(tmp_path_factory.mktemp("beam-model"), seed=11)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(model_dir)


def engine(model_dir: str, **kwargs) -> LLM:
    return LLM(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 << 20, **kwargs)


@pytest.fixture(scope="module")
def llm(model_dir):
    with engine(model_dir) as instance:
        yield instance


def hf_sum_logprob(model, tokens: list[int], prompt_len: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[pos - 1, tokens[pos]]) for pos in range(prompt_len, len(tokens)))


def test_beams_equal_hf_beam_search(llm, hf):
    model, tokenizer = hf
    prompt_ids = [tokenizer(text).input_ids for text in PROMPTS]
    outputs = llm.beam_search([{"prompt_token_ids": ids} for ids in prompt_ids],
                              BeamSearchParams(beam_width=3, max_tokens=6))
    assert len(outputs) == len(PROMPTS) and all(isinstance(output, BeamSearchOutput) for output in outputs)
    eos = set(llm.llm_engine.input_processor.eos_token_ids)
    for ids, output in zip(prompt_ids, outputs):
        # The comparison's premise: no end-of-sequence token was ever a candidate.
        assert not any(eos & set(step) for seq in output.sequences for step in seq.logprobs)
        with torch.no_grad():
            reference = model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, do_sample=False,
                                       max_new_tokens=6, length_penalty=1.0)
        expected = [row[len(ids):].tolist() for row in reference]
        assert [seq.tokens[len(ids):] for seq in output.sequences] == expected
        for seq in output.sequences:
            assert seq.tokens[:len(ids)] == ids  # vLLM's convention: tokens start with the prompt
            assert seq.cum_logprob == pytest.approx(hf_sum_logprob(model, seq.tokens, len(ids)), abs=1e-3)
            assert seq.finish_reason == "length" and seq.text == tokenizer.decode(seq.tokens)
            assert len(seq.logprobs) == 6 and all(len(step) >= 6 for step in seq.logprobs)


def test_strings_concurrency_limit_and_progress_bar_give_the_same_beams(llm, hf):
    _, tokenizer = hf
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    by_ids = llm.beam_search([{"prompt_token_ids": tokenizer(text).input_ids} for text in PROMPTS], params)
    by_text = llm.beam_search(PROMPTS, params, concurrency_limit=1, use_tqdm=True)
    assert [[s.tokens for s in o.sequences] for o in by_text] == [[s.tokens for s in o.sequences] for o in by_ids]


def test_end_of_sequence_and_length_penalty(tmp_path, hf):
    # The same weights (seed 11) with, as EOS, the token greedy decoding picks second: the search meets it early.
    model, tokenizer = hf
    ids = tokenizer(PROMPTS[0]).input_ids
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False)[0, len(ids):].tolist()
    eos_id = greedy[1]
    directory = build(tmp_path / "eos", seed=11, eos_token_id=eos_id)
    with engine(directory) as llm:
        for penalty in (0.0, 1.0, 2.0):
            output = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=5,
                                                                                    length_penalty=penalty))[0]
            sequences = output.sequences
            stopped = [seq for seq in sequences if seq.finish_reason == "stop"]
            for seq in stopped:
                assert seq.tokens[-1] == eos_id and seq.stop_reason == eos_id
                assert seq.text == tokenizer.decode(seq.tokens[:-1])  # the EOS text is left out
                assert seq.cum_logprob == pytest.approx(hf_sum_logprob(model, seq.tokens, len(ids)), abs=1e-3)
            # Ranked by cum_logprob / length ** penalty, length without the final EOS.
            scores = [seq.cum_logprob / ((len(seq.tokens) - (seq.finish_reason == "stop")) ** penalty)
                      for seq in sequences]
            assert scores == sorted(scores, reverse=True)
            assert scores == [beam_search_score(s.tokens, s.cum_logprob, frozenset({eos_id}), penalty)
                              for s in sequences]
        # With no length penalty the short sequence that ends in EOS after two tokens wins: its
        # cum_logprob is the sum of two logprobs, every longer one sums more negative ones.
        best = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=5,
                                                                              length_penalty=0.0))[0].sequences[0]
        assert best.finish_reason == "stop" and best.tokens[len(ids):] == greedy
        with_eos = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(
            beam_width=3, max_tokens=5, ignore_eos=True, include_stop_str_in_output=True))[0]
        assert all(len(seq.tokens) == len(ids) + 5 and seq.finish_reason == "length" for seq in with_eos.sequences)


def test_a_beam_ends_at_max_model_len(llm):
    prompt = list(range(10, 10 + MAX_MODEL_LEN - 2))
    output = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=5))[0]
    assert all(len(seq.tokens) == MAX_MODEL_LEN and seq.finish_reason == "length" for seq in output.sequences)


def test_invalid_arguments_name_the_field(llm):
    with pytest.raises(ValueError, match="beam_width=11 needs 22 logprobs.*max_logprobs") as info:
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    assert info.value.field == "beam_width"
    for kwargs, field in ((dict(beam_width=0, max_tokens=2), "beam_width"), (dict(beam_width=2, max_tokens=0),
                                                                            "max_tokens"),
                          (dict(beam_width=2, max_tokens=2, length_penalty=float("inf")), "length_penalty"),
                          (dict(beam_width=2, max_tokens=2, temperature=-0.5), "temperature"),
                          (dict(beam_width=2, max_tokens=2, ignore_eos="yes"), "ignore_eos")):
        with pytest.raises(ValueError, match=f"BeamSearchParams.{field}") as info:
            BeamSearchParams(**kwargs)
        assert info.value.field == field
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    for call, field in ((lambda: llm.beam_search(["hi"], {"beam_width": 2}), "params"),
                        (lambda: llm.beam_search([{"prompt": "hi", "multi_modal_data": {}}], params), "prompts[0]"),
                        (lambda: llm.beam_search([3], params), "prompts[0]"),
                        # A list of chat messages is generate()'s form, not beam_search's (vLLM's).
                        (lambda: llm.beam_search([[{"role": "user", "content": "hi"}]], params), "prompts[0]"),
                        (lambda: llm.beam_search(["hi"], params, concurrency_limit=0), "concurrency_limit"),
                        (lambda: llm.beam_search(["hi", "yo"], params, lora_request=[None]), "lora_request")):
        with pytest.raises(ValueError) as info:
            call()
        assert info.value.field == field
    # A prompt is checked as generate() checks one: no room under max_model_len, empty.
    for prompt in ([7] * MAX_MODEL_LEN, []):
        with pytest.raises(ValueError, match="prompts\\[1\\]") as info:
            llm.beam_search(["hi", {"prompt_token_ids": prompt}], params)
        assert info.value.field == "prompt"
    # Inside a prompt dict the engine's own prompt handling names the key, and the message the prompt.
    for prompt, field in (({"prompt": 5}, "prompt"), ({"prompt": "\ud800"}, "prompt"),
                          ({"prompt_token_ids": [1, "a"]}, "prompt_token_ids[1]")):
        with pytest.raises(ValueError, match="prompts\\[1\\]") as info:
            llm.beam_search(["hi", prompt], params)
        assert info.value.field == field
    # The engine still serves after the refusals.
    assert llm.beam_search("hi", params)[0].sequences


def test_every_prompt_form_is_read_as_generate_reads_it(llm, hf):
    import types

    import numpy as np

    _, tokenizer = hf
    ids = tokenizer(PROMPTS[0]).input_ids
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    forms = [PROMPTS[0], {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}, {"prompt_token_ids": np.array(ids)},
             {"prompt": "ignored: the token ids win", "prompt_token_ids": ids},
             types.MappingProxyType({"prompt_token_ids": ids})]
    outputs = llm.beam_search(forms, params)
    expected = [seq.tokens for seq in outputs[2].sequences]
    for output in outputs:
        assert [seq.tokens for seq in output.sequences] == expected
        # Plain ints, whatever the prompt held (a numpy array's are numpy integers).
        assert all(type(token) is int for seq in output.sequences for token in seq.tokens)
    assert [seq.tokens for seq in llm.beam_search(types.MappingProxyType({"prompt": PROMPTS[0]}),
                                                  params)[0].sequences] == expected
    assert [prompt.prompt_token_ids for prompt in llm.generate(forms[:4], SamplingParams(max_tokens=1),
                                                                   use_tqdm=False)] == [ids] * 4


def test_max_logprobs_allows_wider_beams(model_dir):
    with engine(model_dir, max_logprobs=30) as llm:
        output = llm.beam_search(["hello"], BeamSearchParams(beam_width=15, max_tokens=2))[0]
        assert len(output.sequences) == 15
        assert len({tuple(seq.tokens) for seq in output.sequences}) == 15


def test_async_llm_beam_search_equals_hf_and_cancelling_it_aborts_the_beams(model_dir, hf):
    import asyncio

    from sparrow import AsyncLLM

    model, tokenizer = hf
    ids = tokenizer(PROMPTS[1]).input_ids

    async def run() -> tuple[list, int, int]:
        engine = AsyncLLM.from_engine_args(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN,
                                           kv_cache_memory_bytes=8 << 20)
        try:
            outputs = [out async for out in engine.beam_search({"prompt_token_ids": ids}, "beams",
                                                                 BeamSearchParams(beam_width=3, max_tokens=6))]
            # A consumer cancelled in the middle of a long search leaves no beam request behind.
            task = asyncio.create_task(anext(engine.beam_search(
                {"prompt_token_ids": ids}, "cancelled", BeamSearchParams(beam_width=3, max_tokens=50))))
            # Cancelled as soon as its beams run (a fixed sleep raced the search's end on a busy machine).
            for _ in range(2000):
                if engine._collectors:  # a step's beam requests are in flight
                    break
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                stats = await engine.get_scheduler_stats()
                if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
                    break
                await asyncio.sleep(0.05)
            return outputs, stats.num_running_reqs + stats.num_waiting_reqs, len(engine._collectors)
        finally:
            engine.shutdown()

    outputs, unfinished, collectors = asyncio.run(run())
    assert len(outputs) == 1 and outputs[0].finished
    with torch.no_grad():
        reference = model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, do_sample=False,
                                   max_new_tokens=6)
    assert [list(choice.token_ids) for choice in outputs[0].outputs] == [row[len(ids):].tolist() for row in reference]
    assert [choice.index for choice in outputs[0].outputs] == [0, 1, 2]
    assert unfinished == 0 and collectors == 0
