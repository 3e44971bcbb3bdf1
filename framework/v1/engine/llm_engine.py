"""vLLM's ``vllm.v1.engine.llm_engine``."""

from sparrow.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
