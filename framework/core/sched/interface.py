"""The scheduler contract the engine core relies on. Pure Python."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparrow.core.request import Request, RequestStatus
    from sparrow.wire import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats


class SchedulerInterface(ABC):
    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Called once per engine step (through the ``sparrow_schedule`` hook), before the model
        runs: decide ``{request_id: num_new_tokens}`` within the token budget, allocating KV slots
        and preempting when they run out."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Called once per step after the model ran: append sampled tokens, apply stop
        conditions, free finished requests, and return what the frontend must hear."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Called when the engine core receives a request; raises ValueError if it can never run."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Called for aborts (client went away, stop string hit in the frontend)."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False when blocks are still in use."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats:
        """Called by the engine core after every step (and by the ``get_scheduler_stats``
        utility): a snapshot of gauges and cumulative counters. Reading it changes nothing, so
        two calls in a row return the same counts."""
