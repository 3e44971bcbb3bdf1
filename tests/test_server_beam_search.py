"""Beam search on the OpenAI server (vLLM's ``use_beam_search``, ``n`` beams), on a real ``sparrow
serve`` with the openai client.

The reference is HF transformers on the same directory: where no end-of-sequence token is a
candidate (asserted from the logprobs the server returns: with ``logprobs = 2 * n`` and
temperature 0 they are every candidate of every step), vLLM's beam search and HF's
``generate(num_beams=n, num_return_sequences=n)`` keep the same beams, so the choices, in order,
must be HF's sequences. The model (seed 11) is tests/test_beam_search.py's, where that holds."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.test_server import API_KEY, MODEL_NAME, serve_for_module, wait_until

PROMPTS = ["The cat sat on the", "Once upon a time there", "1 2 3 4 5 6 7 8"]
MESSAGES = [{"role": "user", "content": "Tell me about sparrows."}]
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from sparrow.tiny.model import build_model_dir

    return str(Path(build_model_dir(tmp_path_factory.mktemp("beam-server-model"), "qwen3", "test", seed=11)))


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serve_for_module(model_dir, tmp_path_factory, "beam-server-logs")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(timeout=60)


def hf_beams(hf, ids: list[int], n: int, max_new_tokens: int) -> list[list[int]]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), num_beams=n, num_return_sequences=n, do_sample=False,
                             max_new_tokens=max_new_tokens, length_penalty=1.0)
    return [row[len(ids):].tolist() for row in out]


def eos_ids(hf) -> set[int]:
    model, tokenizer = hf
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured]) - {None}
    return ids | {tokenizer.eos_token_id}


def as_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def test_completions_choices_are_hf_beam_search(client, hf):
    _, tokenizer = hf
    prompts = [tokenizer(text).input_ids for text in PROMPTS]
    n, steps = 3, 6
    response = client.completions.create(model=MODEL_NAME, prompt=prompts, n=n, max_tokens=steps, logprobs=2 * n,
                                         extra_body={**BEAM, "return_tokens_as_token_ids": True})
    assert [choice.index for choice in response.choices] == list(range(n * len(prompts)))
    eos = eos_ids(hf)
    for prompt_index, ids in enumerate(prompts):
        choices = response.choices[prompt_index * n:(prompt_index + 1) * n]
        # The comparison's premise: no end-of-sequence token was a candidate of any step.
        assert not any(eos & {as_id(key) for key in top} for choice in choices for top in choice.logprobs.top_logprobs)
        got = [[as_id(token) for token in choice.logprobs.tokens] for choice in choices]
        assert got == hf_beams(hf, ids, n, steps)  # the same beams, best first
        for choice, tokens in zip(choices, got):
            assert choice.finish_reason == "length" and choice.text == tokenizer.decode(tokens)
            assert all(len(top) == 2 * n for top in choice.logprobs.top_logprobs)
    assert response.usage.prompt_tokens == sum(len(ids) for ids in prompts)
    assert response.usage.completion_tokens == len(prompts) * n * steps
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    # Streamed: the same choices (in one chunk), then the usage.
    stream = client.completions.create(model=MODEL_NAME, prompt=prompts[0], n=n, max_tokens=steps, stream=True,
                                       stream_options={"include_usage": True}, extra_body=BEAM)
    texts, usage = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert [texts[index] for index in range(n)] == [choice.text for choice in response.choices[:n]]
    assert usage.completion_tokens == n * steps


def test_chat_returns_n_beams_as_hf_beam_search(client, hf):
    _, tokenizer = hf
    n, steps = 2, 5
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=n, max_completion_tokens=steps, logprobs=True, top_logprobs=2 * n,
        extra_body={**BEAM, "return_tokens_as_token_ids": True})
    assert [choice.index for choice in response.choices] == list(range(n))
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    eos = eos_ids(hf)
    assert not any(eos & {as_id(top.token) for top in entry.top_logprobs}
                   for choice in response.choices for entry in choice.logprobs.content)
    got = [[as_id(entry.token) for entry in choice.logprobs.content] for choice in response.choices]
    assert got == hf_beams(hf, ids, n, steps)
    for choice, tokens in zip(response.choices, got):
        assert choice.message.role == "assistant" and choice.message.content == tokenizer.decode(tokens,
                                                                                                 skip_special_tokens=True)
        assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == n * steps
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=n, max_completion_tokens=steps,
                                            stream=True, extra_body=BEAM)
    contents, finishes = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            contents[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert contents == [choice.message.content for choice in response.choices] and finishes == ["length"] * n


def test_length_penalty_ignore_eos_and_temperature_are_taken(client):
    # Every beam runs max_tokens here, so the penalty cannot reorder them: the choices stay the same.
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=2, max_tokens=3, extra_body=BEAM)
    for fields in ({"length_penalty": 0.0, "ignore_eos": True}, {"length_penalty": 2.0},
                   {"include_stop_str_in_output": True}):
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=2, max_tokens=3,
                                             extra_body={**BEAM, **fields})
        assert [choice.text for choice in response.choices] == [choice.text for choice in plain.choices]
        assert response.usage.completion_tokens == 6
    # temperature > 0 adds one sampled token to each step's candidates: still n beams of max_tokens.
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=2, max_tokens=3, temperature=1.0,
                                         extra_body=BEAM)
    assert len(response.choices) == 2 and response.usage.completion_tokens == 6


@pytest.fixture(scope="module")
def eos_server(hf, tmp_path_factory):
    """The same weights with, as EOS, the token greedy decoding picks second after PROMPTS[0]:
    the search meets it at once (tests/test_beam_search.py's set-up)."""
    from tests.test_beam_search import build

    model, tokenizer = hf
    ids = tokenizer(PROMPTS[0]).input_ids
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False)[0, len(ids):].tolist()
    directory = build(tmp_path_factory.mktemp("beam-eos-model"), seed=11, eos_token_id=greedy[1])
    for server in serve_for_module(directory, tmp_path_factory, "beam-eos-logs"):
        yield server, ids, greedy, directory


def hf_sum_logprob(model, tokens: list[int], prompt_len: int) -> float:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    return sum(float(logprobs[pos - 1, tokens[pos]]) for pos in range(prompt_len, len(tokens)))


def test_eos_ends_a_beam_and_length_penalty_ranks_them(eos_server, hf):
    server, ids, greedy, _ = eos_server
    model, tokenizer = hf
    eos_id = greedy[1]
    client = server.client(timeout=60)
    for penalty in (0.0, 1.0, 2.0):
        response = client.completions.create(
            model=MODEL_NAME, prompt=ids, n=3, max_tokens=5, logprobs=0,
            extra_body={**BEAM, "length_penalty": penalty, "return_tokens_as_token_ids": True})
        scores = []
        for choice in response.choices:
            tokens = [as_id(token) for token in choice.logprobs.tokens]
            cum_logprob = sum(choice.logprobs.token_logprobs)
            assert cum_logprob == pytest.approx(hf_sum_logprob(model, ids + tokens, len(ids)), abs=1e-3)
            if choice.finish_reason == "stop":  # an EOS ended it: its text leaves the EOS out
                assert tokens[-1] == eos_id and choice.stop_reason == eos_id
                assert choice.text == tokenizer.decode(tokens[:-1])
            else:
                assert choice.finish_reason == "length" and len(tokens) == 5 and eos_id not in tokens
            # vLLM's score: the length counts the prompt, not a final EOS.
            scores.append(cum_logprob / (len(ids) + len(tokens) - (choice.finish_reason == "stop")) ** penalty)
        assert scores == sorted(scores, reverse=True)
        if penalty == 0.0:
            # No length penalty: the two-token sequence that ends in EOS wins (every longer one
            # sums more negative logprobs).
            best = response.choices[0]
            assert best.finish_reason == "stop" and [as_id(token) for token in best.logprobs.tokens] == greedy
    kept = client.completions.create(model=MODEL_NAME, prompt=ids, n=3, max_tokens=5,
                                     extra_body={**BEAM, "length_penalty": 0.0, "include_stop_str_in_output": True})
    assert kept.choices[0].text == tokenizer.decode(greedy)
    ignored = client.completions.create(model=MODEL_NAME, prompt=ids, n=3, max_tokens=5,
                                        extra_body={**BEAM, "length_penalty": 0.0, "ignore_eos": True})
    assert all(choice.finish_reason == "length" for choice in ignored.choices)
    assert ignored.usage.completion_tokens == 15


def test_the_server_and_llm_beam_search_give_the_same_beams_and_texts(eos_server, hf):
    # One search and one decoding of a beam (sparrow.beam_search) behind both: the same beams,
    # and the same text of the generated tokens, a final EOS shown only with include_stop_str_in_output.
    from sparrow.beam_search import beam_text
    from sparrow.sampling_params import BeamSearchParams
    from tests.test_beam_search import engine

    server, ids, greedy, directory = eos_server
    _, tokenizer = hf
    client = server.client(timeout=60)
    with engine(directory) as llm:
        for include in (False, True):
            params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.0,
                                      include_stop_str_in_output=include)
            offline = llm.beam_search([{"prompt_token_ids": ids}], params)[0].sequences
            response = client.completions.create(
                model=MODEL_NAME, prompt=ids, n=3, max_tokens=5, logprobs=0,
                extra_body={**BEAM, "length_penalty": 0.0, "include_stop_str_in_output": include,
                            "return_tokens_as_token_ids": True})
            assert offline[0].finish_reason == "stop"  # the premise: an EOS ends the best beam
            assert [[as_id(token) for token in choice.logprobs.tokens] for choice in response.choices] == \
                [seq.tokens[len(ids):] for seq in offline]
            assert [(choice.finish_reason, choice.stop_reason) for choice in response.choices] == \
                [(seq.finish_reason, seq.stop_reason) for seq in offline]
            texts = [choice.text for choice in response.choices]
            assert texts == [beam_text(tokenizer, seq, params, len(ids), {"skip_special_tokens": True})
                             for seq in offline]
            assert texts[0] == tokenizer.decode(greedy if include else greedy[:-1])


REFUSED = [
    # (endpoint, fields, param)
    ("completions", {"top_p": 0.5}, "top_p"),
    ("completions", {"top_k": 5}, "top_k"),
    ("completions", {"min_p": 0.1}, "min_p"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
    ("completions", {"stop": ["the"]}, "stop"),
    ("completions", {"stop_token_ids": [5]}, "stop_token_ids"),
    ("completions", {"min_tokens": 2}, "min_tokens"),
    ("completions", {"bad_words": ["cat"]}, "bad_words"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"guided_regex": "[a-z]+"}, "guided_regex"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"seed": 3, "temperature": 0.5}, "seed"),
    ("completions", {"n": 11}, "n"),  # 2 * 11 logprobs > max_logprobs (20)
    ("completions", {"n": 2, "logprobs": 5}, "logprobs"),
    ("completions", {"max_tokens": 600}, "max_tokens"),  # beyond max_model_len, as for any request
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, "tools"),
    ("chat", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ("chat", {"n": 2, "logprobs": True, "top_logprobs": 5}, "top_logprobs"),
]


def test_what_beam_search_cannot_honour_is_a_400_naming_it(client):
    for endpoint, fields, param in REFUSED:
        body = {**BEAM, **fields}
        with pytest.raises(openai.BadRequestError) as info:
            if endpoint == "completions":
                client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=body.pop("max_tokens", 2),
                                          extra_body=body)
            else:
                client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2,
                                               extra_body=body)
        assert info.value.body["param"] == param, (fields, info.value.body)
    # length_penalty without beam search is refused too.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2,
                                  extra_body={"length_penalty": 1.0})
    assert info.value.body["param"] == "length_penalty" and "use_beam_search" in info.value.body["message"]


def test_beam_search_beside_ordinary_requests_changes_nothing(server, client):
    def ordinary(index: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt=f"{PROMPTS[index % 3]} {index}", max_tokens=12,
                                         temperature=0.0, extra_body={"ignore_eos": True}).choices[0].text

    alone = [ordinary(index) for index in range(4)]
    beam_alone = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], n=4, max_tokens=20,
                                           extra_body={**BEAM, "ignore_eos": True})
    results: dict[str, object] = {}

    def beam() -> None:
        results["beam"] = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], n=4, max_tokens=20,
                                                    extra_body={**BEAM, "ignore_eos": True})

    thread = threading.Thread(target=beam)
    thread.start()

    async def together() -> list[str]:
        async with server.async_client(timeout=60) as async_client:
            responses = await asyncio.gather(*(async_client.completions.create(
                model=MODEL_NAME, prompt=f"{PROMPTS[index % 3]} {index}", max_tokens=12, temperature=0.0,
                extra_body={"ignore_eos": True}) for index in range(4)))
        return [response.choices[0].text for response in responses]

    beside = asyncio.run(together())
    thread.join(60)
    assert beside == alone
    assert [choice.text for choice in results["beam"].choices] == [choice.text for choice in beam_alone.choices]


def test_a_beam_search_whose_client_gives_up_is_aborted(server, client):
    def finished() -> float:  # requests finished so far, whatever the reason
        return sum(value for name, value in server.metrics().items()
                   if name.startswith("sparrow:request_success_total"))

    def quiet_for_a_second() -> bool:
        before = finished()
        time.sleep(1.0)
        metrics = server.metrics()
        return (finished() == before and metrics["sparrow:num_requests_running"] == 0
                and metrics["sparrow:num_requests_waiting"] == 0)

    finished_before = finished()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    n, max_tokens = 6, 300
    body = {"model": MODEL_NAME, "prompt": PROMPTS[2], "n": n, "max_tokens": max_tokens, "ignore_eos": True, **BEAM}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=0.5)
    # The search stops: no beam step is submitted any more (the one in flight, if any, is aborted;
    # a search cancelled between steps has none), long before its max_tokens steps of n requests.
    wait_until(quiet_for_a_second, timeout_s=30.0, what="the beam search to stop submitting steps")
    assert 0 < finished() - finished_before < n * max_tokens / 2
    wait_until(lambda: server.metrics()["sparrow:kv_cache_usage_perc"] == 0.0, what="blocks to be freed")
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=2, max_tokens=3, extra_body=BEAM)
    assert len(response.choices) == 2
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2).usage.completion_tokens >= 1
