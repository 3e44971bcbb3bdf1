"""vLLM's ``vllm.v1.outputs``."""

from sparrow.worker.outputs import ModelRunnerOutput

__all__ = ["ModelRunnerOutput"]
