"""Messages between the frontend (P0) and the engine core (P1).

Their home is :mod:`sparrow.wire`, with every other message that crosses a process; the names
are re-exported here for the code and the plugins that import them from this module.
"""

from __future__ import annotations

from sparrow.wire import (
    SCHEDULER_STATS_COUNTERS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    HandshakeMessage,
    SchedulerStats,
    UtilityOutput,
)

__all__ = [
    "SCHEDULER_STATS_COUNTERS", "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "EngineCoreRequestType",
    "FinishReason", "HandshakeMessage", "SchedulerStats", "UtilityOutput",
]
