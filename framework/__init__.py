"""Sparrow: a small, pluggable LLM inference engine with vLLM's public API.

Names are imported lazily so that ``import sparrow.core...`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "sparrow.entrypoints.llm",
    "AsyncLLM": "sparrow.engine.async_llm",
    "SamplingParams": "sparrow.sampling_params",
    "RequestOutputKind": "sparrow.sampling_params",
    "RequestOutput": "sparrow.outputs",
    "CompletionOutput": "sparrow.outputs",
    "Logprob": "sparrow.outputs",
    "EngineConfig": "sparrow.config",
    "ConfigError": "sparrow.config",
    "LoRARequest": "sparrow.lora.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sparrow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
