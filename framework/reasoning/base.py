"""The reasoning-parser interface: how one model family marks the reasoning before its answer.

A parser is registered by name (``sparrow_register_reasoning_parsers``, chosen with the engine
argument ``reasoning_parser``) and built once per process with the tokenizer. Two processes ask
it different questions:

    engine core   token ids: has the prompt already ended the reasoning? does this sampled token
                  end it? Structured outputs constrain only what follows (the manager).
    server        text: which part of a choice's text is ``reasoning_content`` and which is
                  ``content``, whole (``extract_reasoning``) or as deltas arrive (``new_stream``).

Nothing here imports torch or the HTTP stack: the engine core imports parsers too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparrow.sampling_options import ThinkingMarkers


@dataclass(slots=True)
class ReasoningDelta:
    """What one piece of a choice's text adds to its reasoning and to its answer."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One choice's split, fed its text as it is generated. ``saw_reasoning`` tells a choice
    that reasoned (perhaps emptily) from one that never did."""

    saw_reasoning: bool = False

    def feed(self, text: str) -> ReasoningDelta:
        """Split the next piece of text; may hold back a partial marker until the next piece."""
        raise NotImplementedError

    def finish(self) -> ReasoningDelta:
        """The text still held back, once the choice has ended."""
        raise NotImplementedError


class ReasoningParser:
    """Base of every reasoning parser. Subclasses implement the four methods below.

    ``keeps_special_tokens``: the markers are special tokens (Mistral's ``[THINK]``), which a
    detokenizer skipping special tokens drops; the server then decodes every chat and Responses
    request with ``skip_special_tokens`` false, so that the split sees them."""

    keeps_special_tokens: bool = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    # -- engine core: token ids -----------------------------------------------------------------
    def reasoning_ended(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the output starts after the reasoning (the chat template closed it already,
        e.g. Qwen3 with ``enable_thinking=False``), so a constraint applies from the first token."""
        raise NotImplementedError

    def ends_reasoning(self, token_id: int) -> bool:
        """Whether this sampled token ends the reasoning; the constraint applies from the next one."""
        raise NotImplementedError

    def thinking_markers(self, prompt_token_ids: Sequence[int]) -> ThinkingMarkers | None:
        """For ``thinking_token_budget``: the token ids that start and end the reasoning, and
        whether this prompt's current turn leaves it open; None when this parser cannot tell
        (the budget is then refused, naming it)."""
        return None

    # -- server: text ---------------------------------------------------------------------------
    def new_stream(self, prompt_token_ids: Sequence[int]) -> ReasoningStream:
        """A fresh split for one choice of a request with this prompt."""
        raise NotImplementedError

    def extract_reasoning(self, text: str, prompt_token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole choice; None where there is none. The same
        split as streaming the text in any pieces."""
        stream = self.new_stream(prompt_token_ids)
        first, last = stream.feed(text), stream.finish()
        reasoning = first.reasoning + last.reasoning
        content = first.content + last.content
        return (reasoning if stream.saw_reasoning else None), (content or None)
