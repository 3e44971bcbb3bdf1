"""vLLM's ``vllm.v1.executor.abstract``."""

from sparrow.executor.abstract import Executor

__all__ = ["Executor"]
