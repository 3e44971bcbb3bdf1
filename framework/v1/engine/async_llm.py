"""vLLM's ``vllm.v1.engine.async_llm``."""

from sparrow.engine.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
