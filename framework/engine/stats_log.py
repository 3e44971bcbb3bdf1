"""vLLM's periodic stats log line (its ``LoggingStatLogger``), one INFO line per interval:

``Engine 000: Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 87.1 tokens/s,
Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 43.0%``

Throughputs are the tokens counted since the previous line divided by the seconds since it; the
prefix cache hit rate is that of the prompt tokens looked up in the interval; running, waiting and
KV cache usage are those of the latest scheduler snapshot. With speculative decoding a second line
follows (vLLM's "SpecDecoding metrics"). When the engine was idle for the whole interval (no token,
no request running or waiting) and the previous line was idle too, the line goes out at DEBUG, so
an idle server does not fill its log.

Fed by a frontend's ``StatLoggerManager`` (``stat_loggers``) through ``record``: every batch's
``IterationStats`` (tokens, prompt tokens counted with a request's first token) and scheduler
snapshot (gauges, and the counters' growth since the snapshot before). ``maybe_log(now)`` logs once
``interval`` seconds have passed, ``log(now)`` at once. Pure Python, one thread; ``now`` is
``time.monotonic()`` seconds.

With data parallelism one frontend feeds one logger the outputs of every engine core and their
stats summed (``dp_client.combine_stats``): the line covers all of them and says so, as vLLM's
aggregated line does ("2 Engines Aggregated: ...", ``num_engines``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sparrow.engine.iteration_stats import IterationStats
from sparrow.engine.stat_loggers import StatLoggerBase
from sparrow.wire import SchedulerStats

logger = logging.getLogger(__name__)


class LoggingStatLogger(StatLoggerBase):
    """vLLM's ``LoggingStatLogger``: the periodic stats line."""

    def __init__(self, interval: float, engine_index: int = 0, now: float | None = None, num_engines: int = 1) -> None:
        if not interval > 0:
            raise ValueError(f"the stats log interval must be > 0 seconds, got {interval!r}")
        self.interval = float(interval)
        self.engine_index = engine_index
        # One engine's line, or the sum of num_engines data-parallel engines'.
        self.prefix = f"Engine {engine_index:03d}: " if num_engines == 1 else f"{num_engines} Engines Aggregated: "
        self.last_log_time = time.monotonic() if now is None else now
        self._last_idle = True  # as vLLM: an engine idle from the start logs at DEBUG
        # Since the last line
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec_decode_num_drafts = 0
        self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0
        self.spec_decode_num_accepted_tokens_per_pos: list[int] = []
        # Gauges of the latest snapshot
        self.num_running_reqs = 0
        self.num_waiting_reqs = 0
        self.kv_cache_usage = 0.0

    # -- feeding ----------------------------------------------------------------------------
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        """``scheduler_stats``' counters are growths (the manager's ``SchedulerStatsDeltas``)."""
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is None:
            return
        new = scheduler_stats
        self.num_running_reqs = new.num_running_reqs
        self.num_waiting_reqs = new.num_waiting_reqs
        self.kv_cache_usage = new.kv_cache_usage
        self.prefix_cache_queries += new.prefix_cache_queries
        self.prefix_cache_hits += new.prefix_cache_hits
        self.spec_decode_num_drafts += new.spec_decode_num_drafts
        self.spec_decode_num_draft_tokens += new.spec_decode_num_draft_tokens
        self.spec_decode_num_accepted_tokens += new.spec_decode_num_accepted_tokens
        mine, new_pos = self.spec_decode_num_accepted_tokens_per_pos, new.spec_decode_num_accepted_tokens_per_pos
        mine.extend([0] * (len(new_pos) - len(mine)))
        for position, delta in enumerate(new_pos):
            mine[position] += delta

    def log_engine_initialized(self) -> None:
        pass  # the engine's start-up lines say what vLLM's would

    # -- logging ----------------------------------------------------------------------------
    def start(self, now: float | None = None) -> None:
        """Start the current interval at ``now`` (a frontend's first request), keeping the counts."""
        self.last_log_time = time.monotonic() if now is None else now

    def format_lines(self, now: float) -> list[str]:
        """The line(s) ``log(now)`` writes, without resetting anything."""
        elapsed = max(now - self.last_log_time, 1e-9)
        hit_rate = 100.0 * self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        lines = [
            f"{self.prefix}"
            f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {self.num_running_reqs} reqs, Waiting: {self.num_waiting_reqs} reqs, "
            f"KV cache usage: {100.0 * self.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"]
        drafts, draft_tokens = self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens
        if drafts > 0:
            accepted = self.spec_decode_num_accepted_tokens
            per_pos = ", ".join(f"{count / drafts:.3f}" for count in self.spec_decode_num_accepted_tokens_per_pos)
            rate = 100.0 * accepted / draft_tokens if draft_tokens else 0.0
            lines.append(
                f"{self.prefix}SpecDecoding metrics: "
                f"Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {draft_tokens / elapsed:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}, "
                f"Avg Draft acceptance rate: {rate:.1f}%")
        return lines

    def log(self, now: float | None = None) -> None:
        """Log the line(s) now and start the next interval."""
        now = time.monotonic() if now is None else now
        idle = (self.num_prompt_tokens == 0 and self.num_generation_tokens == 0
                and self.num_running_reqs == 0 and self.num_waiting_reqs == 0)
        level = logging.DEBUG if idle and self._last_idle else logging.INFO
        for line in self.format_lines(now):
            logger.log(level, "%s", line)
        self._last_idle = idle
        self.last_log_time = now
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.spec_decode_num_drafts = self.spec_decode_num_draft_tokens = self.spec_decode_num_accepted_tokens = 0
        self.spec_decode_num_accepted_tokens_per_pos = [0] * len(self.spec_decode_num_accepted_tokens_per_pos)
