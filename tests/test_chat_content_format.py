"""vLLM's chat_template_content_format: a message's content reaches the chat template as a string
or as a list of parts, as the template reads it ("auto": found in the template's syntax tree).
A list handed to a template that prints ``message.content`` used to come out as its Python repr."""

from __future__ import annotations

import pytest

from sparrow.engine.chat_content import template_iterates_content

STRING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for part in m.content %}[{{ part.text }}]"
                  "{% endfor %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PARTS = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]


@pytest.mark.parametrize(("template", "iterates"), [
    (STRING_TEMPLATE, False),
    (PARTS_TEMPLATE, True),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% set c = m.content if m.content is not none else '' %}{% if c is string %}{{ c }}"
     "{% else %}{% for p in c | list %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}", True),
    ("{% for m in messages %}{% for key in m %}{{ key }}{% endfor %}{% endfor %}", False),
    ("{% for m in messages %", False),  # a syntax error: rendering reports it
])
def test_auto_finds_templates_that_iterate_the_content(template, iterates):
    assert template_iterates_content(template) is iterates


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    from sparrow import LLM

    llm = LLM(qwen3_dir, multiprocess=False, max_model_len=256, num_kv_blocks=32)
    yield llm
    llm.shutdown()


def hf_prompt_ids(tokenizer, messages, template) -> list[int]:
    """HF transformers' rendering of the same messages, tokenized as the engine tokenizes a chat."""
    text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def chat_prompt_ids(llm, content, template, content_format="auto") -> list[int]:
    from sparrow import SamplingParams

    [output] = llm.chat([{"role": "user", "content": content}], SamplingParams(max_tokens=1), use_tqdm=False,
                        chat_template=template, chat_template_content_format=content_format)
    return list(output.prompt_token_ids)


def test_each_template_gets_the_content_it_reads(llm):
    tokenizer = llm.get_tokenizer()
    joined = hf_prompt_ids(tokenizer, [{"role": "user", "content": "Hello\nthere"}], STRING_TEMPLATE)
    as_parts = hf_prompt_ids(tokenizer, [{"role": "user", "content": PARTS}], PARTS_TEMPLATE)
    one_part = hf_prompt_ids(tokenizer, [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                             PARTS_TEMPLATE)
    # A string template gets the parts' texts joined by newlines, never the list's repr.
    assert chat_prompt_ids(llm, PARTS, STRING_TEMPLATE) == joined
    assert chat_prompt_ids(llm, PARTS, STRING_TEMPLATE, "string") == joined
    # A template that iterates the parts gets parts, also from a string.
    assert chat_prompt_ids(llm, PARTS, PARTS_TEMPLATE) == as_parts
    assert chat_prompt_ids(llm, "Hi", PARTS_TEMPLATE) == one_part
    assert chat_prompt_ids(llm, "Hi", STRING_TEMPLATE, "openai") != chat_prompt_ids(llm, "Hi", STRING_TEMPLATE)
    # The model's own template reads both forms: the same prompt either way.
    assert chat_prompt_ids(llm, [{"type": "text", "text": "Hi"}], None) == chat_prompt_ids(llm, "Hi", None)


def test_the_servers_rendering_gets_the_content_the_template_reads(llm):
    """The server's rendering (its --chat-template-content-format): parts for a template that
    loops over them, unless "string" joins them; the text for a template that prints the content."""
    from sparrow.entrypoints.openai.protocol import ChatCompletionRequest
    from sparrow.entrypoints.openai.serving_chat import render_prompt

    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": PARTS}])
    processor, tokenizer = llm.llm_engine.input_processor, llm.get_tokenizer()
    assert render_prompt(processor, request, PARTS_TEMPLATE)["prompt_token_ids"] == \
        hf_prompt_ids(tokenizer, [{"role": "user", "content": PARTS}], PARTS_TEMPLATE)
    # "string" is the server's to choose: the template then gets the joined text, as HF would render it.
    assert render_prompt(processor, request, PARTS_TEMPLATE, "string")["prompt_token_ids"] == \
        hf_prompt_ids(tokenizer, [{"role": "user", "content": "Hello\nthere"}], PARTS_TEMPLATE)
    assert render_prompt(processor, request, STRING_TEMPLATE)["prompt_token_ids"] == \
        hf_prompt_ids(tokenizer, [{"role": "user", "content": "Hello\nthere"}], STRING_TEMPLATE)


@pytest.mark.parametrize(("content", "content_format", "field"), [
    ("Hi", "jinja", "chat_template_content_format"),
    ([{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}], "string",
     "messages[0].content[1]"),
])
def test_what_cannot_be_rendered_is_refused_naming_the_field(llm, content, content_format, field):
    with pytest.raises(ValueError) as info:
        chat_prompt_ids(llm, content, STRING_TEMPLATE, content_format)
    assert getattr(info.value, "field", None) == field, info.value
