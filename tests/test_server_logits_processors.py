"""bad_words and vllm_xargs through `sparrow serve` (completions and chat, the real `openai`
client), checked against HF transformers with the words banned by hand; the server enables a
plugin processor by qualified name, built in its engine process."""

from __future__ import annotations

import openai
import pytest

from sparrow.sample.logits_processor.words import bad_words_token_ids
from tests.test_logits_processors import MAX_TOKENS, PROMPTS, hf_greedy, hf_model, one_token_word, tokenizer  # noqa: F401 - fixtures, used by name
from tests.test_server import MODEL_NAME, serve_for_module


def token_ids_of(labels: list[str]) -> list[int]:
    return [int(label.removeprefix("token_id:")) for label in labels]


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    yield from serve_for_module(qwen3_dir, tmp_path_factory, "logits-processor-logs",
                                "--logits-processors", "tests.test_logits_processors:TargetTokenProcessor")


def test_bad_words_and_vllm_xargs_through_completions_and_chat(server, hf_model, tokenizer):
    client = server.client()
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 1}
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    prompt = tokenizer.encode(PROMPTS[1])
    free = hf_greedy(hf_model, prompt, MAX_TOKENS)
    word = one_token_word(tokenizer, free)
    choice = client.completions.create(model=MODEL_NAME, prompt=prompt, **sampling,
                                       extra_body={**extra, "bad_words": [word]}).choices[0]
    expected = hf_greedy(hf_model, prompt, MAX_TOKENS, bad_words_token_ids(tokenizer, [word], len(tokenizer)))
    assert token_ids_of(choice.logprobs.tokens) == expected != free

    messages = [{"role": "user", "content": "Name three colours."}]
    chat_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                   add_special_tokens=False)
    free = hf_greedy(hf_model, chat_prompt, MAX_TOKENS)
    word = one_token_word(tokenizer, free)
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0.0, max_completion_tokens=MAX_TOKENS, logprobs=True,
        extra_body={**extra, "bad_words": [word]}).choices[0]
    expected = hf_greedy(hf_model, chat_prompt, MAX_TOKENS, bad_words_token_ids(tokenizer, [word], len(tokenizer)))
    assert token_ids_of([entry.token for entry in choice.logprobs.content]) == expected != free

    # The engine's plugin processor, with its per-request argument.
    choice = client.completions.create(model=MODEL_NAME, prompt=prompt, **sampling,
                                       extra_body={**extra, "vllm_xargs": {"target_token": 9}}).choices[0]
    assert token_ids_of(choice.logprobs.tokens) == [9] * MAX_TOKENS
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=2,
                                       extra_body={"vllm_xargs": {"target_token": -3}})
    assert info.value.body["param"] == "vllm_xargs" and "target_token" in info.value.body["message"]
