"""The built-in tool and reasoning parsers, registered through the same hooks a plugin uses.

Registered by the kernel (``sparrow.plugins.KERNEL_PLUGINS``); the parser modules are imported
only when the registry is built, and they import neither torch nor the HTTP stack.
"""

from __future__ import annotations

from typing import Callable

from sparrow.hookspecs import hookimpl


@hookimpl
def sparrow_register_tool_parsers(register: Callable[..., None]) -> None:
    from sparrow.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser

    register("hermes", HermesToolParser)
    register("llama3_json", Llama3JsonToolParser)
    # Imported when chosen (--tool-call-parser), by "module:Class".
    register("mistral", "sparrow.entrypoints.openai.tool_parsers.mistral:MistralToolParser")
    register("pythonic", "sparrow.entrypoints.openai.tool_parsers.pythonic:PythonicToolParser")
    register("qwen3_coder", "sparrow.entrypoints.openai.tool_parsers.qwen3_coder:Qwen3CoderToolParser")
    register("deepseek_v3", "sparrow.entrypoints.openai.tool_parsers.deepseek_v3:DeepSeekV3ToolParser")
    register("glm45", "sparrow.entrypoints.openai.tool_parsers.glm45:Glm45ToolParser")
    register("kimi_k2", "sparrow.entrypoints.openai.tool_parsers.kimi_k2:KimiK2ToolParser")
    register("granite", "sparrow.entrypoints.openai.tool_parsers.granite:GraniteToolParser")
    register("phi4_mini_json", "sparrow.entrypoints.openai.tool_parsers.phi4_mini_json:Phi4MiniJsonToolParser")


@hookimpl
def sparrow_register_reasoning_parsers(register: Callable[..., None]) -> None:
    from sparrow.reasoning import (
        DeepSeekR1ReasoningParser,
        DeepSeekV3ReasoningParser,
        Glm45ReasoningParser,
        MistralReasoningParser,
        Qwen3ReasoningParser,
    )

    register("qwen3", Qwen3ReasoningParser)
    register("deepseek_r1", DeepSeekR1ReasoningParser)
    register("deepseek_v3", DeepSeekV3ReasoningParser)
    register("glm45", Glm45ReasoningParser)
    register("mistral", MistralReasoningParser)
