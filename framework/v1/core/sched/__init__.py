"""vLLM's ``vllm.v1.core.sched``."""
