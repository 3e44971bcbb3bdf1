"""What each batch of engine-core outputs did, measured once in the frontend for every stat logger.

vLLM's ``IterationStats`` and ``FinishedRequestStats`` (``sparrow.v1.metrics.stats`` re-exports
them): the tokens a batch produced, the prompt tokens of the requests whose first token came in it,
their time to first token, the gaps between consecutive token outputs, and the requests that
finished (in the engine core, by a stop string, aborted or rejected) with their whole-request
figures. ``RequestStatsTracker`` keeps the per-request timestamps between batches. Every logger
(the stats line, the Prometheus metrics, a user's own) reads the same objects, so they agree on
every count.

Latencies are ``time.monotonic()`` seconds (the clock ``arrival_time`` is stamped with);
``iteration_timestamp`` is ``time.time()`` (wall clock, for loggers that write records). A request
with n > 1 counts each of its samples, as each is its own engine-core request. Pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from sparrow.wire import EngineCoreOutput


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished engine-core request."""

    finish_reason: str  # "stop", "length", "abort", "repetition" or "error"
    e2e_latency: float = 0.0  # seconds from arrival to finish
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    time_to_first_token: float | None = None  # None when it finished before its first token


@dataclass(slots=True)
class IterationStats:
    """One batch of engine-core outputs (or a request finished in the frontend between batches)."""

    iteration_timestamp: float = field(default_factory=time.time)
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # of the requests whose first token came in this batch
    num_preempted_reqs: int = 0  # preemptions since the previous scheduler snapshot
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RequestStateStats:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0


class RequestStatsTracker:
    """Engine-core request id -> its timestamps and counts while unfinished. One thread."""

    def __init__(self) -> None:
        self._requests: dict[str, RequestStateStats] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, engine_id: str, arrival_time: float, num_prompt_tokens: int,
                    max_tokens: int | None) -> None:
        self._requests[engine_id] = RequestStateStats(arrival_time or time.monotonic(), num_prompt_tokens,
                                                      max_tokens)

    def update_from_outputs(self, stats: IterationStats, outputs: Iterable[EngineCoreOutput], now: float) -> None:
        """Count one batch into ``stats``; outputs of untracked requests (aborted before their
        output arrived) and error finishes (the caller finishes those as "error") are skipped."""
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None or output.error_message is not None:
                continue
            state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
            if output.new_token_ids:
                num_new = len(output.new_token_ids)
                stats.num_generation_tokens += num_new
                state.num_generation_tokens += num_new
                if state.first_token_time is None:
                    state.first_token_time = now
                    stats.time_to_first_tokens_iter.append(now - state.arrival_time)
                    stats.num_prompt_tokens += state.num_prompt_tokens
                else:
                    stats.inter_token_latencies_iter.append(now - (state.last_token_time or now))
                state.last_token_time = now
            elif output.pooling_output is not None:  # a pooling request's prompt is done: no tokens follow
                stats.num_prompt_tokens += state.num_prompt_tokens
            if output.finish_reason is not None:
                self.finish(stats, output.request_id, str(output.finish_reason), now)

    def finish(self, stats: IterationStats, engine_id: str, finish_reason: str, now: float | None = None) -> None:
        """The request ended (once: later calls for it do nothing); its figures go into ``stats``."""
        state = self._requests.pop(engine_id, None)
        if state is None:
            return
        now = time.monotonic() if now is None else now
        ttft = None if state.first_token_time is None else state.first_token_time - state.arrival_time
        stats.finished_requests.append(FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=now - state.arrival_time,
            num_prompt_tokens=state.num_prompt_tokens, num_generation_tokens=state.num_generation_tokens,
            max_tokens_param=state.max_tokens, num_cached_tokens=state.num_cached_tokens,
            time_to_first_token=ttft))
