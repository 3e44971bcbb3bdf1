"""Sparrow: a small, pluggable LLM inference engine with vLLM's public API.

Names are imported lazily so that ``import sparrow.core...`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module, or (module, name there) for an alias
_EXPORTS: dict[str, str | tuple[str, str]] = {
    "LLM": "sparrow.entrypoints.llm",
    "LLMEngine": "sparrow.engine.llm_engine",
    "AsyncLLM": "sparrow.engine.async_llm",
    "AsyncLLMEngine": ("sparrow.engine.async_llm", "AsyncLLM"),  # vLLM V1's alias
    "EngineArgs": "sparrow.engine.arg_utils",
    "AsyncEngineArgs": "sparrow.engine.arg_utils",
    "SamplingParams": "sparrow.sampling_params",
    "RequestOutputKind": "sparrow.sampling_params",
    "RequestOutput": "sparrow.outputs",
    "CompletionOutput": "sparrow.outputs",
    "Logprob": "sparrow.outputs",
    "PoolingParams": "sparrow.pooling_params",
    "PoolingOutput": "sparrow.outputs",
    "PoolingRequestOutput": "sparrow.outputs",
    "EmbeddingOutput": "sparrow.outputs",
    "EmbeddingRequestOutput": "sparrow.outputs",
    "ClassificationOutput": "sparrow.outputs",
    "ClassificationRequestOutput": "sparrow.outputs",
    "ScoringOutput": "sparrow.outputs",
    "ScoringRequestOutput": "sparrow.outputs",
    "PromptType": "sparrow.inputs",
    "TextPrompt": "sparrow.inputs",
    "TokensPrompt": "sparrow.inputs",
    "EngineConfig": "sparrow.config",
    "ConfigError": "sparrow.config",
    "LoRARequest": "sparrow.lora.request",
    "ModelRegistry": "sparrow.model_registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'sparrow' has no attribute {name!r}")
    module, attribute = where if isinstance(where, tuple) else (where, name)
    return getattr(importlib.import_module(module), attribute)
