"""vLLM's ``thinking_token_budget``: after that many tokens inside the reasoning, the reasoning's
end marker (``</think>`` for the qwen3 parser) is forced; the reasoning may end by itself before.

Reference: HF transformers' greedy ``generate`` on the same directory with the rule written by
hand as a transformers LogitsProcessor (count the tokens after ``<think>``, force ``</think>`` at
the budget). Prompts leave the reasoning open (the thinking chat template writes ``<think>``),
close it (``enable_thinking=False``), or have none (the model opens it itself, pushed by a
logit_bias, possibly several times). The server's field is checked in test_reasoning.
"""

from __future__ import annotations

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.errors import InvalidArgumentError
from tests.test_reasoning import add_think_tokens

MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def think_dir(qwen3_dir, tmp_path_factory) -> str:
    return add_think_tokens(qwen3_dir, tmp_path_factory.mktemp("budget") / "model")


@pytest.fixture(scope="module")
def tokenizer(think_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(think_dir)


@pytest.fixture(scope="module")
def markers(tokenizer) -> tuple[int, int]:
    return tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")


class HandWrittenBudget:
    """transformers LogitsProcessor: the budget rule, read from the whole sequence each step."""

    def __init__(self, prompt_len: int, open_in_prompt: bool, budget: int, start: int, end: int) -> None:
        self.prompt_len, self.open_in_prompt, self.budget, self.start, self.end = (
            prompt_len, open_in_prompt, budget, start, end)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        thinking, count = self.open_in_prompt, 0
        for token in input_ids[0, self.prompt_len:].tolist():
            if not thinking:
                thinking, count = token == self.start, 0
            elif token == self.end:
                thinking = False
            else:
                count += 1
        if thinking and count >= self.budget:
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.end] = 0.0
            return forced
        return scores


def hf_greedy(think_dir: str, prompt: list[int], budget: int | None, open_in_prompt: bool, markers,
              bias: dict[int, float] | None = None) -> list[int]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(think_dir, dtype=torch.float32, local_files_only=True).eval()
    processors = []
    if bias:  # logit_bias, applied before the budget's forcing (as the engine's processors are ordered)
        def add_bias(_ids, scores):
            for token, value in bias.items():
                scores[:, token] += value
            return scores
        processors.append(add_bias)
    if budget is not None:
        processors.append(HandWrittenBudget(len(prompt), open_in_prompt, budget, *markers))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


def chat_prompt(tokenizer, thinking: bool) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=thinking)
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_end_marker_is_forced_at_the_budget(think_dir, tokenizer, markers):
    thinking, answering = chat_prompt(tokenizer, True), chat_prompt(tokenizer, False)
    start, end = markers
    plain = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    cases = [  # (prompt, budget, left open by the prompt, logit_bias)
        (thinking, 0, True, None), (thinking, 5, True, None), (thinking, None, True, None),
        (answering, 3, False, None),  # the prompt closed the reasoning: nothing to bound
        (plain, 4, False, {start: 9.0}),  # the model opens <think> itself, again after each forced end
    ]
    llm = LLM(think_dir, dtype="float32", max_model_len=256, reasoning_parser="qwen3", max_num_batched_tokens=32)
    try:
        # One batch: rows with and without a budget side by side.
        outputs = llm.generate(
            [{"prompt_token_ids": prompt} for prompt, *_ in cases],
            [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,  # HF's min_new_tokens
                            thinking_token_budget=budget, logit_bias=bias) for _, budget, _, bias in cases],
            use_tqdm=False)
    finally:
        llm.shutdown()
    for output, (prompt, budget, open_in_prompt, bias) in zip(outputs, cases):
        expected = hf_greedy(think_dir, prompt, budget, open_in_prompt, markers, bias)
        assert output.outputs[0].token_ids == expected, (budget, open_in_prompt)
    budgeted = outputs[1].outputs[0].token_ids
    assert budgeted[5] == end and end not in budgeted[:5]  # five tokens of reasoning, then </think>
    assert outputs[0].outputs[0].token_ids[0] == end
    opened = outputs[4].outputs[0].token_ids
    assert opened.count(start) >= 2 and opened.count(end) >= 1  # opened by the model, closed, opened again


def test_a_budget_needs_a_reasoning_parser(qwen3_dir):
    llm = LLM(qwen3_dir, multiprocess=False, max_model_len=128)
    try:
        with pytest.raises(InvalidArgumentError, match="thinking_token_budget needs the engine's reasoning_parser"):
            llm.generate("hello", SamplingParams(max_tokens=4, thinking_token_budget=8), use_tqdm=False)
    finally:
        llm.shutdown()
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "no limit"
    with pytest.raises(InvalidArgumentError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2)
