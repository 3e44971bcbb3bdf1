"""Tool parsers: turn a model's output text into OpenAI tool calls (``tool_choice: "auto"``).

The built-in ones (``hermes``, ``llama3_json``; ``mistral``, ``pythonic``, ``qwen3_coder``,
``deepseek_v3``, ``glm45``, ``kimi_k2``, ``granite`` and ``phi4_mini_json`` by import path, loaded
when chosen) register through ``sparrow_register_tool_parsers`` like a plugin's
(``sparrow.entrypoints.openai.parser_hooks``).
"""

from sparrow.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    StreamingToolParser,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
    new_tool_call_id,
)
from sparrow.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from sparrow.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

__all__ = ["ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "ParsedToolCall",
           "StreamingToolParser", "ToolCallDelta", "ToolParser", "ToolStreamDelta", "new_tool_call_id"]
