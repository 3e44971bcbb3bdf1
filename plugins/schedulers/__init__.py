"""Built-in scheduler policies, registered through the same entry point a third party uses.

Each policy reuses the kernel's :class:`~sparrow.core.sched.scheduler.Scheduler` machinery and
overrides only its ordering decisions. Running the chosen policy each step is the kernel's own
default of ``sparrow_schedule`` (``sparrow.core.default_hooks``), so this plugin only registers.
"""

from __future__ import annotations

from sparrow.hookspecs import hookimpl
from sparrow_schedulers.policies import (
    FCFSScheduler,
    LongestPrefixMatchScheduler,
    PriorityScheduler,
    ShortestJobFirstScheduler,
)

__all__ = ["FCFSScheduler", "LongestPrefixMatchScheduler", "PriorityScheduler", "ShortestJobFirstScheduler"]

# The hook-contract versions this plugin supports (sparrow.hookspecs.CONTRACT_VERSION).
SPARROW_CONTRACT = ">=1.0,<2"


@hookimpl
def sparrow_register_schedulers(register) -> None:
    register("fcfs", FCFSScheduler)
    register("priority", PriorityScheduler)
    register("sjf", ShortestJobFirstScheduler)
    register("lpm", LongestPrefixMatchScheduler)
