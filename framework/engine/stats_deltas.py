"""What is new in each ``SchedulerStats`` snapshot, for the readers of its cumulative counters.

A snapshot's counters (``SCHEDULER_STATS_COUNTERS`` and the per-position accepted draft tokens)
are cumulative since the engine core started. Both the Prometheus metrics (``metrics.py``) and the
periodic stats line (``stats_log.py``) need only what grew since the snapshot before, and both see
snapshots more than once (a step's, then ``get_scheduler_stats``'s) or late (an older one after a
newer one). ``SchedulerStatsDeltas`` keeps the high-water mark of every counter and hands out the
growth past it, so each event counts once whatever order the snapshots come in.
"""

from __future__ import annotations

import msgspec

from sparrow.wire import SCHEDULER_STATS_COUNTERS, SchedulerStats


class SchedulerStatsDeltas:
    """Successive snapshots -> the growth of their counters. One reader each (not thread-safe)."""

    def __init__(self) -> None:
        # The highest value of every counter seen so far.
        self._seen = SchedulerStats()

    def update(self, stats: SchedulerStats) -> SchedulerStats:
        """``stats``'s gauges, with each counter replaced by its growth past the highest value
        seen before (0 when it did not grow), and the per-position accepted tokens by their growth
        per position (as long as the longest list seen so far, as the high-water marks are)."""
        seen = self._seen
        deltas: dict[str, int] = {}
        for name in SCHEDULER_STATS_COUNTERS:
            total = getattr(stats, name)
            new = total - getattr(seen, name)
            deltas[name] = max(new, 0)
            if new > 0:
                setattr(seen, name, total)
        seen_pos = seen.spec_decode_num_accepted_tokens_per_pos
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        seen_pos.extend([0] * (len(per_pos) - len(seen_pos)))
        new_pos = [0] * len(seen_pos)
        for position, total in enumerate(per_pos):
            if total > seen_pos[position]:
                new_pos[position] = total - seen_pos[position]
                seen_pos[position] = total
        return msgspec.structs.replace(stats, spec_decode_num_accepted_tokens_per_pos=new_pos, **deltas)
