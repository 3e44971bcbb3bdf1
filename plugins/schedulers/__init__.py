"""Built-in scheduler policies, registered through the same entry point a third party uses.

Each policy reuses the kernel's :class:`~sparrow.core.sched.scheduler.Scheduler` machinery and
overrides only its ordering decisions.
"""

from __future__ import annotations

from sparrow.core.sched.interface import SchedulerInterface
from sparrow.core.sched.output import SchedulerOutput
from sparrow.hookspecs import hookimpl

from sparrow_schedulers.policies import (
    FCFSScheduler,
    LongestPrefixMatchScheduler,
    PriorityScheduler,
    ShortestJobFirstScheduler,
)

__all__ = ["FCFSScheduler", "LongestPrefixMatchScheduler", "PriorityScheduler", "ShortestJobFirstScheduler"]


@hookimpl
def sparrow_register_schedulers(register) -> None:
    register("fcfs", FCFSScheduler)
    register("priority", PriorityScheduler)
    register("sjf", ShortestJobFirstScheduler)
    register("lpm", LongestPrefixMatchScheduler)


@hookimpl(trylast=True)
def sparrow_schedule(scheduler: SchedulerInterface) -> SchedulerOutput:
    return scheduler.schedule()
