"""What the scheduler decided for one step (crosses to the workers).

The home of these messages is :mod:`sparrow.wire`; the names are re-exported here for the code
and the plugins that import them from this module.
"""

from __future__ import annotations

from sparrow.wire import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: F401 - re-exported
