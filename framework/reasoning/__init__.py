"""Reasoning parsers: split a model's reasoning (``reasoning_content``) from its answer.

The built-in ones (``qwen3``, ``deepseek_r1``, ``deepseek_v3``, ``glm45``, ``mistral``) register
through ``sparrow_register_reasoning_parsers`` like a plugin's (``sparrow.entrypoints.openai.parser_hooks``).
"""

from sparrow.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from sparrow.reasoning.think import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Glm45ReasoningParser,
    MistralReasoningParser,
    Qwen3ReasoningParser,
    ThinkReasoningParser,
)

__all__ = ["DeepSeekR1ReasoningParser", "DeepSeekV3ReasoningParser", "Glm45ReasoningParser", "MistralReasoningParser",
           "Qwen3ReasoningParser", "ReasoningDelta", "ReasoningParser", "ReasoningStream", "ThinkReasoningParser"]
