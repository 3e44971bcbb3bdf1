"""Stop conditions the engine core decides (stop strings are the frontend's: they need text)."""

from __future__ import annotations

from sparrow.core.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """After ``token_id`` was appended: the finished status and stop reason, or (None, None)."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in (params.all_stop_token_ids or ()) or token_id in (params.stop_token_ids or ()):
            return RequestStatus.FINISHED_STOPPED, token_id
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None, None
