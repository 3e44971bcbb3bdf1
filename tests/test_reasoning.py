"""Reasoning output: the <think> parsers on hand-written text (whole, and streamed in random
chunkings that must add up to the whole), the engine core applying a grammar only after the
reasoning ends (under preemption), the parser hook, and `sparrow serve --reasoning-parser` with
the real `openai` client.

The test model's tokenizer gets `<think>` and `</think>` as tokens of their own (two merges of its
BPE give up their ids) and a Qwen3-style template that opens the reasoning in the prompt, or
closes it there when `enable_thinking` is false. The random-weight model writes `</think>` only
when a logit_bias favours it: then it reasons for a few dozen tokens, and its answer must
satisfy the grammar, which cannot have applied before (a JSON grammar never allows `</think>`).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from sparrow import LLM
from sparrow.hookspecs import hookimpl
from sparrow.plugins import get_registry
from sparrow.reasoning import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Glm45ReasoningParser,
    Qwen3ReasoningParser,
)
from sparrow.sampling_params import SamplingParams, StructuredOutputsParams
from sparrow.tiny.tokenizer import CHAT_TEMPLATE
from tests.test_hooks import registered
from tests.test_server import MODEL_NAME, free_port, serve_for_module
from tests.test_structured_outputs import run

SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["n", "kind"], "additionalProperties": False}
END_BIAS = 10.0  # on </think>: a few dozen tokens of reasoning at most, then the answer
MAX_TOKENS = 200  # far above what that reasoning and the longest answer take
MESSAGES = [{"role": "user", "content": "Think, then answer in JSON."}]
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' -}}",
    "{{- '<|im_start|>assistant\\n' -}}{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<think>\\n' -}}{%- endif -%}")
assert THINKING_TEMPLATE != CHAT_TEMPLATE


def add_think_tokens(model_dir: str, out: Path, tags: tuple[str, ...] = ("<think>", "</think>"),
                     special: bool = False, template: str = THINKING_TEMPLATE) -> str:
    """A copy of ``model_dir`` whose tokenizer has <think> and </think> (not special: they decode
    as text, as in Qwen3's), or ``tags`` (special ones with ``special``), and the thinking template."""
    shutil.copytree(model_dir, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    bpe = tokenizer["model"]
    by_id = {token_id: token for token, token_id in bpe["vocab"].items()}
    for token_id, tag in zip(sorted(by_id)[-len(tags):], tags):
        merged = by_id[token_id]  # the last merges: rare words, nothing the tests need
        del bpe["vocab"][merged]
        bpe["merges"] = [merge for merge in bpe["merges"]
                         if "".join(merge if isinstance(merge, list) else merge.split(" ")) != merged]
        tokenizer["added_tokens"].append({"id": token_id, "content": tag, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": special})
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module")
def think_dir(qwen3_dir, tmp_path_factory) -> str:
    return add_think_tokens(qwen3_dir, tmp_path_factory.mktemp("think") / "model")


@pytest.fixture(scope="module")
def tokenizer(think_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(think_dir)


# A tool-calling loop's prompt (Qwen3's template): the previous assistant turn's reasoning is
# repeated, closed, before the tool's answer and the new turn, which reasons again.
TOOL_LOOP = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nplan\n</think>\n\n<tool_call>\n{}"
             "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")
# GLM-4.5's: every earlier assistant turn carries <think></think>; the new turn opens with <|assistant|>.
GLM_TURNS = {"glm_open": "<|user|>\nHi<|assistant|>\n<think></think>\nHello<|user|>\nAgain<|assistant|>",
             "glm_off": "<|user|>\nHi<|assistant|>\n<think></think>"}


def prompt_ids(tokenizer, kind: str) -> list[int]:
    """open: no tag in the prompt; thinking: it ends with <think>; answering: it closed the
    reasoning; tool_loop: an earlier turn closed it; glm_*: GLM-4.5's turns."""
    if kind == "open":
        text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    elif kind == "tool_loop":
        text = TOOL_LOOP
    elif kind in GLM_TURNS:
        text = GLM_TURNS[kind]
    else:
        text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=kind == "thinking")
    return tokenizer.encode(text, add_special_tokens=False)


# -- the parsers on hand-written text -----------------------------------------------------------
PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser, "glm45": Glm45ReasoningParser,
           "deepseek_v3": DeepSeekV3ReasoningParser}
CASES = [
    ("qwen3", "tool_loop", "<think>\nagain</think>\n\ncall", ("\nagain", "\n\ncall")),
    ("qwen3", "tool_loop", "no tags", (None, "no tags")),
    ("glm45", "glm_open", "<think>plan</think>answer", ("plan", "answer")),
    ("glm45", "glm_open", "an answer", (None, "an answer")),
    ("glm45", "glm_off", "<think>x</think>y", (None, "<think>x</think>y")),
    # (parser, prompt, model text, (reasoning_content, content))
    ("qwen3", "open", "<think>\nplan a</think>\n\nanswer", ("\nplan a", "\n\nanswer")),
    ("qwen3", "open", "  <think>cut short", ("cut short", None)),
    ("qwen3", "open", "An answer; <think> here is text.", (None, "An answer; <think> here is text.")),
    ("qwen3", "thinking", "plan</think>answer", ("plan", "answer")),
    ("qwen3", "thinking", "still thinking < </", ("still thinking < </", None)),
    ("qwen3", "thinking", '</think>{"n": 1}', ("", '{"n": 1}')),
    ("qwen3", "answering", "<think>x</think>y", (None, "<think>x</think>y")),
    ("deepseek_r1", "open", "plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", "open", "<think>plan</think>answer </think>", ("plan", "answer </think>")),
    ("deepseek_r1", "open", "only a plan", ("only a plan", None)),
    ("deepseek_r1", "thinking", "a</thin", ("a</thin", None)),
    # DeepSeek-V3.1: thinking on opens <think> in the prompt, off closes it; no tags is an answer
    ("deepseek_v3", "thinking", "plan</think>answer", ("plan", "answer")),
    ("deepseek_v3", "answering", "<think>x</think>y", (None, "<think>x</think>y")),
    ("deepseek_v3", "open", "plan</think>answer", (None, "plan</think>answer")),
    ("deepseek_v3", "open", "<think>plan</think>answer", ("plan", "answer")),
]


@pytest.fixture(scope="module")
def glm_tokenizer(qwen3_dir, tmp_path_factory):
    """The tokenizer with GLM-4.5's turn token too."""
    from transformers import AutoTokenizer

    model = add_think_tokens(qwen3_dir, tmp_path_factory.mktemp("glm") / "model",
                             ("<think>", "</think>", "<|assistant|>", "<|user|>"))
    return AutoTokenizer.from_pretrained(model)


def case_tokenizer(request, name):
    return request.getfixturevalue("glm_tokenizer" if name == "glm45" else "tokenizer")


@pytest.mark.parametrize("name, prompt, text, expected", CASES)
def test_think_parsers_split_hand_written_text(request, name, prompt, text, expected):
    tokenizer = case_tokenizer(request, name)
    parser = PARSERS[name](tokenizer)
    assert parser.extract_reasoning(text, prompt_ids(tokenizer, prompt)) == expected


def streamed_splits(parser, prompt: list[int], text: str, rounds: int = 40):
    """``text`` fed to fresh streams in random pieces (seeded by the text): per round, the pieces'
    deltas and the split they add up to, ``(reasoning or None, content or None)``."""
    rng = random.Random(text)
    for _ in range(rounds):
        stream = parser.new_stream(prompt)
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randrange(0, min(10, len(text) - 1))))
        pieces = [stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [stream.finish()]
        reasoning = "".join(piece.reasoning for piece in pieces)
        content = "".join(piece.content for piece in pieces)
        yield pieces, (reasoning if stream.saw_reasoning else None, content or None)


@pytest.mark.parametrize("name, prompt, text, expected", CASES)
def test_streaming_in_random_chunkings_equals_the_whole(request, name, prompt, text, expected):
    tokenizer = case_tokenizer(request, name)
    for pieces, split in streamed_splits(PARSERS[name](tokenizer), prompt_ids(tokenizer, prompt), text):
        assert split == expected
        assert all("</think>" not in piece.reasoning for piece in pieces)


def test_the_engine_side_reads_token_ids(tokenizer, qwen3_dir):
    from transformers import AutoTokenizer

    parser = Qwen3ReasoningParser(tokenizer)
    kinds = ("open", "thinking", "answering", "tool_loop")
    assert [parser.reasoning_ended(prompt_ids(tokenizer, kind)) for kind in kinds] == [False, False, True, False]
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    assert parser.ends_reasoning(end_id) and not parser.ends_reasoning(end_id - 2)
    with pytest.raises(ValueError, match="reasoning_parser: .*'</think>' as one token"):
        Qwen3ReasoningParser(AutoTokenizer.from_pretrained(qwen3_dir))


# -- the engine core -----------------------------------------------------------------------------
def constrained(tokenizer, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                          logit_bias={tokenizer.convert_tokens_to_ids("</think>"): END_BIAS},
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


def test_the_grammar_applies_after_the_reasoning_under_preemption(think_dir, tokenizer):
    # 20 blocks of 16 tokens for a batch needing several times that: requests are preempted and
    # resumed mid-reasoning and mid-answer; the grammar's state must survive both.
    llm = LLM(think_dir, multiprocess=False, dtype="float32", max_model_len=300, num_kv_blocks=20,
              max_num_batched_tokens=48, reasoning_parser="qwen3")
    try:
        rng = random.Random(0)
        prompts, params, kinds = [], [], []
        for seed in range(8):
            kind = "answering" if seed % 4 == 3 else "thinking"
            filler = [rng.randrange(3, 4000) for _ in range(rng.randrange(0, 40))]
            prompts.append({"prompt_token_ids": filler + prompt_ids(tokenizer, kind)})
            params.append(constrained(tokenizer, seed))
            kinds.append(kind)
        outputs, num_preemptions = run(llm, prompts, params)
    finally:
        llm.shutdown()
    assert num_preemptions > 0
    reasoned = 0
    for output, kind in zip(outputs, kinds):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        reasoning, end, answer = completion.text.partition("</think>")
        if kind == "answering":  # the prompt ended the reasoning: JSON from the first token
            assert not end
            answer = reasoning
        else:
            assert end, completion.text  # the grammar did not forbid </think> while reasoning
            reasoned += bool(reasoning.strip())
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert reasoned >= 3


class AlwaysAnswering(Qwen3ReasoningParser):
    """A plugin's parser that says every prompt has already ended the reasoning."""

    def reasoning_ended(self, prompt_token_ids):
        return True


def test_sparrow_register_reasoning_parsers(think_dir, tokenizer):
    class Plugin:
        @hookimpl
        def sparrow_register_reasoning_parsers(self, register):
            register("always_answering", AlwaysAnswering)

    with registered(Plugin(), "reasoning-plugin"):
        assert get_registry().reasoning_parsers["always_answering"] is AlwaysAnswering
        llm = LLM(think_dir, multiprocess=False, dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=16 << 20, reasoning_parser="always_answering")
        try:
            prompt = {"prompt_token_ids": prompt_ids(tokenizer, "thinking")}
            completion = llm.generate(prompt, constrained(tokenizer, 1), use_tqdm=False)[0].outputs[0]
        finally:
            llm.shutdown()
    # The engine core asked the plugin: the grammar applied from the first token.
    assert completion.finish_reason == "stop" and "</think>" not in completion.text
    jsonschema.validate(json.loads(completion.text), SCHEMA)
    with pytest.raises(ValueError, match="unknown reasoning parser 'always_answering'; registered: deepseek_r1, "
                                         "deepseek_v3, glm45, mistral, qwen3"):
        LLM(think_dir, multiprocess=False, reasoning_parser="always_answering")


# -- through the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(think_dir, tmp_path_factory):
    yield from serve_for_module(think_dir, tmp_path_factory, "reasoning-logs", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def ask(client, tokenizer, stream=False, **kwargs):
    kwargs = {"temperature": 1.0, "max_completion_tokens": MAX_TOKENS, **kwargs}
    kwargs.setdefault("logit_bias", {str(tokenizer.convert_tokens_to_ids("</think>")): END_BIAS})
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=stream, **kwargs)


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_reasoning_content_and_a_constrained_answer_streamed_and_not(client, tokenizer):
    reasoned = 0
    for seed in (1, 2, 3, 4):
        choice = ask(client, tokenizer, seed=seed, response_format=json_format(SCHEMA)).choices[0]
        message = choice.message
        assert choice.finish_reason == "stop" and isinstance(message.reasoning_content, str), message
        assert "</think>" not in message.reasoning_content + message.content
        jsonschema.validate(json.loads(message.content), SCHEMA)
        reasoned += bool(message.reasoning_content.strip())
        reasoning, content, finish = "", "", None
        for chunk in ask(client, tokenizer, True, seed=seed, response_format=json_format(SCHEMA)):
            for streamed in chunk.choices:
                reasoning += getattr(streamed.delta, "reasoning_content", None) or ""
                content += streamed.delta.content or ""
                finish = streamed.finish_reason or finish
        assert (reasoning, content, finish) == (message.reasoning_content, message.content, "stop")
    assert reasoned >= 2


def test_thinking_off_means_no_reasoning_and_the_constraint_from_the_start(client, tokenizer):
    choice = ask(client, tokenizer, seed=4, response_format=json_format(SCHEMA), logit_bias=None,
                 extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert choice.finish_reason == "stop" and getattr(choice.message, "reasoning_content", None) is None
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_include_reasoning_false_keeps_only_the_answer(client, tokenizer):
    choice = ask(client, tokenizer, seed=1, response_format=json_format(SCHEMA),
                 extra_body={"include_reasoning": False}).choices[0]
    assert getattr(choice.message, "reasoning_content", None) is None
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


def test_sdk_parse_reads_the_answer_after_the_reasoning(client, tokenizer):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    bias = {str(tokenizer.convert_tokens_to_ids("</think>")): END_BIAS}
    completion = parse(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=5, logit_bias=bias,
                       max_completion_tokens=MAX_TOKENS, response_format=Pet)
    assert isinstance(completion.choices[0].message.parsed, Pet)


def test_a_tokenizer_without_the_end_token_fails_at_start_up_in_one_line(qwen3_dir, tmp_path):
    result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", qwen3_dir, "--port",
                             str(free_port()), "--reasoning-parser", "qwen3", "--max-model-len", "256",
                             "--kv-cache-memory-bytes", str(16 << 20)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("sparrow: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "invalid engine argument 'reasoning_parser': 'qwen3' cannot work with the tokenizer" in errors[0]
    assert "needs '</think>' as one token" in errors[0]


def test_a_tokenizer_without_the_end_token_is_a_config_error_before_the_engine_starts(qwen3_dir):
    from sparrow.config import ConfigError

    with pytest.raises(ConfigError, match=r"'reasoning_parser': 'deepseek_r1' cannot work with the tokenizer .*"
                                          r"'</think>' as one token"):
        LLM(qwen3_dir, reasoning_parser="deepseek_r1", max_model_len=256, kv_cache_memory_bytes=16 << 20)



def test_thinking_token_budget_ends_the_reasoning_on_time(client, tokenizer):
    # tests/test_thinking_budget.py checks the tokens against HF transformers; here the server's field.
    end = tokenizer.convert_tokens_to_ids("</think>")
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_completion_tokens=10,
        extra_body={"thinking_token_budget": 3, "ignore_eos": True, "return_token_ids": True}).choices[0]
    assert choice.token_ids[3] == end and end not in choice.token_ids[:3], choice.token_ids
    assert choice.message.reasoning_content == tokenizer.decode(choice.token_ids[:3])
    refused = client.chat.completions.with_raw_response.create
    with pytest.raises(openai.BadRequestError) as caught:
        refused(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4,
                extra_body={"thinking_token_budget": 3, "use_beam_search": True})
    assert caught.value.body["param"] == "thinking_token_budget"
