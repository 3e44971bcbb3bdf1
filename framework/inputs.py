"""vLLM's prompt types (``vllm.inputs``), for code that builds prompts with them.

    from sparrow import LLM, TokensPrompt
    llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3]))

They are plain dicts (``TypedDict``): ``LLM.generate``, ``LLMEngine.add_request`` and
``AsyncLLM.generate`` take them as they take ``{"prompt": ...}`` and ``{"prompt_token_ids": ...}``.
``EmbedsPrompt`` needs an engine started with ``enable_prompt_embeds=True``.
vLLM's other keys (``multi_modal_data``, ``mm_processor_kwargs``, ``cache_salt``, ...) are not
declared here; a prompt carrying one is refused, naming the key.
"""

from __future__ import annotations

from typing import Any, TypedDict

from typing_extensions import NotRequired  # typing's from Python 3.11; pydantic depends on it

from sparrow.engine.input_processor import PromptType

__all__ = ["EmbedsPrompt", "PromptType", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt already tokenized; ``prompt``, if given, is its text (kept for the output)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    """A prompt given as embeddings (vLLM's): a floating tensor [num_tokens, hidden_size] the model
    reads in place of its token embeddings. Needs ``enable_prompt_embeds=True``."""

    prompt_embeds: Any
    cache_salt: NotRequired[str]
