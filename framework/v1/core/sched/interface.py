"""vLLM's ``vllm.v1.core.sched.interface``."""

from sparrow.core.sched.interface import SchedulerInterface

__all__ = ["SchedulerInterface"]
