"""``<think>...</think>`` reasoning, as Qwen3, DeepSeek-R1 and V3.1 and GLM-4.5 write it (vLLM's
``qwen3``, ``deepseek_r1``, ``deepseek_v3`` and ``glm45`` parsers), and Mistral's ``[THINK]...[/THINK]`` (``mistral``).

Where the reasoning starts depends on the chat template, so each request looks at its prompt's
current turn (after the last turn-start token: Qwen3's ``<|im_start|>``, R1's ``<｜Assistant｜>``,
GLM's ``<|assistant|>``), where the template may have opened or closed the reasoning:

    current turn's last tag   the output starts
    ``<think>``               inside the reasoning (DeepSeek-R1's template, Qwen3 thinking models)
    ``</think>``              after it (Qwen3 with enable_thinking=False): all content
    none                      with an optional ``<think>``; without one, Qwen3's and GLM's output is
                              content and DeepSeek-R1's is reasoning (R1 always reasons first)

Earlier turns do not count: in a tool-calling loop the template repeats the previous assistant
turn's ``<think>...</think>``, and the new turn reasons again.

The end tag must be one token of the vocabulary (the engine core watches for its id); both tags
must decode as text, as they do in Qwen3's and R1's tokenizers, or the parser says
``keeps_special_tokens`` (Mistral's, whose tags are special tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

from sparrow.entrypoints.openai.markers import opens_with, partial_marker_len
from sparrow.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from sparrow.sampling_options import ThinkingMarkers


class _State(Enum):
    OPEN = "open"  # nothing seen yet: an opening tag may come
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkStream(ReasoningStream):
    """One choice's split. Text is buffered only while it may be (the start of) a tag."""

    def __init__(self, start_tag: str, end_tag: str, state: _State, reasoning_first: bool) -> None:
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.reasoning_first = reasoning_first
        self._state = state
        self._buffer = ""
        self.saw_reasoning = state is _State.REASONING

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while True:
            if self._state is _State.OPEN:
                opened = opens_with(self._buffer, self.start_tag, final=final)
                if opened is None:
                    return out
                if opened:
                    self._buffer = self._buffer.lstrip()[len(self.start_tag):]
                    self._state = _State.REASONING
                else:
                    self._state = _State.REASONING if self.reasoning_first else _State.CONTENT
                self.saw_reasoning = self.saw_reasoning or self._state is _State.REASONING
                continue
            if self._state is _State.REASONING:
                found = self._buffer.find(self.end_tag)
                if found >= 0:
                    out.reasoning += self._buffer[:found]
                    self._buffer = self._buffer[found + len(self.end_tag):]
                    self._state = _State.CONTENT
                    continue
                keep = 0 if final else partial_marker_len(self._buffer, self.end_tag)
                out.reasoning += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            out.content += self._buffer
            self._buffer = ""
            return out


class ThinkReasoningParser(ReasoningParser):
    """``<think>`` reasoning ``</think>`` answer."""

    start_tag = "<think>"
    end_tag = "</think>"
    reasoning_first = False  # an output without tags is content (Qwen3) or reasoning (DeepSeek-R1)
    turn_start_tags: tuple[str, ...] = ()  # tokens that open a turn of the chat template

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        if self.end_tag not in vocab:
            raise ValueError(f"reasoning_parser: this parser needs {self.end_tag!r} as one token of the "
                             "tokenizer's vocabulary, and the tokenizer has no such token")
        self.end_token_id: int = vocab[self.end_tag]
        self.start_token_id: int | None = vocab.get(self.start_tag)
        self.turn_start_ids = frozenset(vocab[tag] for tag in self.turn_start_tags if tag in vocab)

    def _last_tag(self, token_ids: Sequence[int]) -> str | None:
        """"start" or "end", whichever tag comes last in the prompt's current turn; None when
        neither does."""
        for token_id in reversed(token_ids):
            if token_id == self.end_token_id:
                return "end"
            if token_id == self.start_token_id:
                return "start"
            if token_id in self.turn_start_ids:
                return None
        return None

    def reasoning_ended(self, prompt_token_ids: Sequence[int]) -> bool:
        return self._last_tag(prompt_token_ids) == "end"

    def ends_reasoning(self, token_id: int) -> bool:
        return token_id == self.end_token_id

    def thinking_markers(self, prompt_token_ids: Sequence[int]) -> ThinkingMarkers:
        last = self._last_tag(prompt_token_ids)
        return ThinkingMarkers(start_token_ids=[] if self.start_token_id is None else [self.start_token_id],
                               end_token_ids=[self.end_token_id],
                               open_in_prompt=last == "start" or (last is None and self.reasoning_first))

    def new_stream(self, prompt_token_ids: Sequence[int]) -> ThinkStream:
        state = {"start": _State.REASONING, "end": _State.CONTENT, None: _State.OPEN}[self._last_tag(prompt_token_ids)]
        return ThinkStream(self.start_tag, self.end_tag, state, self.reasoning_first)


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: reasons in ``<think>`` tags when thinking is on; an untagged output is the answer."""

    reasoning_first = False
    turn_start_tags = ("<|im_start|>",)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: always reasons first; its template may already have opened ``<think>``."""

    reasoning_first = True
    turn_start_tags = ("<｜Assistant｜>",)


class DeepSeekV3ReasoningParser(ThinkReasoningParser):
    """DeepSeek-V3.1 and later (vLLM's ``deepseek_v3``): reasoning only when the request turns
    thinking on (``chat_template_kwargs: {"thinking": true}``), which its template marks by ending
    the prompt's turn with ``<think>``; with thinking off it ends it with ``</think>``, and a
    template with neither (DeepSeek-V3-0324) gives an answer unless the model opens ``<think>``."""

    reasoning_first = False
    turn_start_tags = ("<｜Assistant｜>",)


class Glm45ReasoningParser(ThinkReasoningParser):
    """GLM-4.5 (vLLM's ``glm45``): as Qwen3, its turns opened by ``<|assistant|>``, after each of
    which its template writes ``<think></think>`` when thinking is off."""

    reasoning_first = False
    turn_start_tags = ("<|assistant|>",)


class MistralReasoningParser(ThinkReasoningParser):
    """Mistral's reasoning models (Magistral, vLLM's ``mistral``): ``[THINK]`` reasoning
    ``[/THINK]`` answer, the markers special tokens of the vocabulary (kept in the text: see
    ``keeps_special_tokens``). An output without ``[THINK]`` is all answer. The current turn
    starts after ``[/INST]``: Magistral's system prompt spells out ``[THINK]...[/THINK]`` as
    an example, and that earlier turn does not count. Unlike vLLM's parser, a ``[THINK]`` after
    the answer has started is part of the answer (vLLM moves the text before it to the answer)."""

    start_tag = "[THINK]"
    end_tag = "[/THINK]"
    reasoning_first = False
    turn_start_tags = ("[/INST]",)
    keeps_special_tokens = True

