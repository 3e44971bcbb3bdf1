"""vLLM's ``vllm.v1.core.sched.output``."""

from sparrow.core.sched.output import SchedulerOutput

__all__ = ["SchedulerOutput"]
