"""vLLM's ``vllm.v1.core.sched.scheduler``."""

from sparrow.core.sched.scheduler import Scheduler

__all__ = ["Scheduler"]
