"""vLLM's ``pause_generation`` / ``resume_generation``, the engine core's half: an RLHF trainer
pauses the engine around a weight update.

    mode      requests unfinished at the pause                     requests added while paused
    abort     aborted at once (their streams end with "abort")     held, not scheduled
    wait      run to completion                                    held, not scheduled
    keep      frozen where they are (no step runs), go on after     held, not scheduled
              resume

``clear_cache`` drops the prefix cache: at once for abort; for keep after preempting the frozen
requests (their KV, computed with the old weights, is recomputed after resume); for wait the
frontend resets it once the requests have drained (``AsyncLLM.pause_generation``). Held requests
go to the scheduler, in arrival order, on resume. Steps in flight (overlapped scheduling) are
collected before abort and keep take effect; their outputs go out with the next step's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparrow.core.request import Request, RequestStatus
from sparrow.errors import InvalidArgumentError
from sparrow.wire import EngineCoreOutput, FinishReason

if TYPE_CHECKING:
    from sparrow.engine.core import EngineCore

PAUSE_MODES = ("abort", "wait", "keep")


def check_pause_mode(mode: Any) -> str:
    if mode not in PAUSE_MODES:
        raise InvalidArgumentError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
    return mode


class PauseState:
    """Whether the engine core is paused, how, and the requests added since."""

    __slots__ = ("mode", "held")

    def __init__(self) -> None:
        self.mode: str | None = None
        self.held: list[Request] = []  # added while paused, in arrival order

    @property
    def paused(self) -> bool:
        return self.mode is not None

    @property
    def frozen(self) -> bool:
        """No step runs: mode keep."""
        return self.mode == "keep"

    def drop(self, request_ids: set[str]) -> None:
        """Forget held requests the frontend aborted."""
        if self.held:
            self.held = [request for request in self.held if request.request_id not in request_ids]


def pause(core: EngineCore, mode: str, clear_cache: bool) -> None:
    check_pause_mode(mode)
    if mode != "wait":
        core._finish_steps_in_flight()
    state = core.pause_state
    state.mode = mode
    scheduler = core.scheduler
    if mode == "abort":
        request_ids = [*getattr(scheduler, "requests", {}), *(request.request_id for request in state.held)]
        scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        state.held = []
        core._defer_outputs([EngineCoreOutput(request_id=request_id, new_token_ids=[],
                                             finish_reason=FinishReason.ABORT) for request_id in request_ids])
    if clear_cache and mode != "wait":
        if mode == "keep":
            preempt = getattr(scheduler, "preempt_running", None)
            if preempt is None:
                raise ValueError(f"pause_generation(mode='keep', clear_cache=True): the scheduler "
                                 f"{type(scheduler).__name__} cannot preempt its running requests; pass "
                                 "clear_cache=False")
            preempt()
        core.reset_prefix_cache()


def resume(core: EngineCore) -> None:
    """Unpause; held requests go to the scheduler. One the scheduler refuses now (it never could
    run) is finished with its error, as it would have been when added."""
    state = core.pause_state
    held, state.held, state.mode = state.held, [], None
    for request in held:
        try:
            core._schedule_request(request)
        except Exception as exc:  # noqa: BLE001 - a request that cannot be scheduled fails alone
            core._defer_outputs([EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                 finish_reason=FinishReason.ABORT, error_message=str(exc),
                                                 error_field=getattr(exc, "field", None))])
