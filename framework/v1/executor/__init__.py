"""vLLM's ``vllm.v1.executor``."""
