"""The ``mistral`` reasoning parser (vLLM's, for Magistral): ``[THINK]reasoning[/THINK]answer``,
where both markers are special tokens that decoding normally drops.

The test model's tokenizer gets ``[THINK]``, ``[/THINK]``, ``[INST]`` and ``[/INST]`` as special
tokens and a Mistral-style template whose system prompt spells out ``[THINK]...[/THINK]`` (as
Magistral's does). Through the server (the real ``openai`` client), the split is checked against
the engine's own token ids decoded by HF transformers with the special tokens kept, split by
hand at the markers.
"""

from __future__ import annotations

import pytest

from sparrow.reasoning import MistralReasoningParser
from tests.test_reasoning import add_think_tokens, streamed_splits
from tests.test_server import MODEL_NAME, serve_for_module

TAGS = ("[THINK]", "[/THINK]", "[INST]", "[/INST]")
TEMPLATE = ("{%- for message in messages -%}{%- if message['role'] == 'system' -%}{{- message['content'] -}}"
            "{%- elif message['role'] == 'user' -%}{{- '[INST]' + message['content'] + '[/INST]' -}}"
            "{%- else -%}{{- message['content'] + '<|im_end|>' -}}{%- endif -%}{%- endfor -%}")
SYSTEM = "Think first, as [THINK]your draft[/THINK] then answer."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a bird?"}]


@pytest.fixture(scope="module")
def mistral_dir(qwen3_dir, tmp_path_factory) -> str:
    return add_think_tokens(qwen3_dir, tmp_path_factory.mktemp("mistral") / "model", TAGS, special=True,
                            template=TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(mistral_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(mistral_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


CASES = [
    ("[THINK]a plan[/THINK]The answer.", ("a plan", "The answer.")),
    ("[THINK]cut short", ("cut short", None)),
    ("Just an answer.", (None, "Just an answer.")),
    ("An answer [THINK]with a tag", (None, "An answer [THINK]with a tag")),
    ("[THINK][/THINK]x", ("", "x")),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_hand_written_text_whole_and_streamed(tokenizer, prompt, text, expected):
    parser = MistralReasoningParser(tokenizer)
    assert parser.keeps_special_tokens
    assert parser.extract_reasoning(text, prompt) == expected
    for _, split in streamed_splits(parser, prompt, text):
        assert split == expected


def test_the_system_prompts_markers_are_an_earlier_turn(tokenizer, prompt):
    parser = MistralReasoningParser(tokenizer)
    think, end_think = (tokenizer.convert_tokens_to_ids(tag) for tag in ("[THINK]", "[/THINK]"))
    assert think in prompt and end_think in prompt  # Magistral-style: the system prompt names both
    assert not parser.reasoning_ended(prompt)  # the current turn (after [/INST]) has not reasoned
    markers = parser.thinking_markers(prompt)
    assert markers.start_token_ids == [think] and markers.end_token_ids == [end_think]
    assert not markers.open_in_prompt
    assert parser.ends_reasoning(end_think) and not parser.ends_reasoning(think)


@pytest.fixture(scope="module")
def client(mistral_dir, tmp_path_factory):
    for server in serve_for_module(mistral_dir, tmp_path_factory, "mistral-logs", "--reasoning-parser", "mistral"):
        yield server.client()


def test_the_server_splits_at_special_token_markers(client, tokenizer):
    """The reply continues an assistant turn opened with [THINK] (continue_final_message), so the
    prompt's current turn leaves the reasoning open; a logit bias makes the random-weight model
    write [/THINK] a few tokens in. The request does not ask for special tokens: the parser does."""
    end_think = tokenizer.convert_tokens_to_ids("[/THINK]")
    request = dict(model=MODEL_NAME, messages=[*MESSAGES, {"role": "assistant", "content": "[THINK]"}],
                   temperature=0, max_completion_tokens=24, logit_bias={str(end_think): 7},
                   extra_body={"ignore_eos": True, "return_token_ids": True, "continue_final_message": True,
                               "add_generation_prompt": False})
    choice = client.chat.completions.create(**request).choices[0]
    ids = choice.token_ids
    assert end_think in ids[1:-1], tokenizer.convert_ids_to_tokens(ids)
    reasoning, _, answer = tokenizer.decode(ids, skip_special_tokens=False).partition("[/THINK]")
    assert (choice.message.reasoning_content, choice.message.content) == (reasoning, answer)
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        for streamed in chunk.choices:
            streamed_reasoning += getattr(streamed.delta, "reasoning_content", None) or ""
            streamed_content += streamed.delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, answer)
