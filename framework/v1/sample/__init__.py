"""vLLM's ``vllm.v1.sample``."""
