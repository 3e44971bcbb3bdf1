"""Stop conditions the engine core decides (stop strings are the frontend's: they need text)."""

from __future__ import annotations

import logging

from sparrow.core.request import Request, RequestStatus
from sparrow.sampling_options import ends_in_repetition

logger = logging.getLogger(__name__)


def check_stop(request: Request, token_id: int, max_model_len: int
               ) -> tuple[RequestStatus | None, int | str | None]:
    """After ``token_id`` was appended: the finished status and stop reason, or (None, None)."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in (params.all_stop_token_ids or ()) or token_id in (params.stop_token_ids or ()):
            return RequestStatus.FINISHED_STOPPED, token_id
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    repetition = params.repetition_detection
    if repetition is not None and repetition.enabled and ends_in_repetition(request.output_token_ids, repetition):
        return RequestStatus.FINISHED_REPETITION, "repetition_detected"
    return None, None


def advance_grammar(request: Request, token_id: int) -> RequestStatus | None:
    """Feed an accepted token to the request's grammar matcher; FINISHED_STOPPED once the grammar
    has reached its end (the token was a stop token the grammar allowed there: with ignore_eos,
    an EOS check_stop let through)."""
    grammar = request.structured_output
    if not grammar.accept_tokens(request.request_id, [token_id]):
        # The bitmask allowed only what the matcher accepts, so this is a bug, not the user's
        # input. The matcher keeps its state: the next mask still follows the grammar.
        logger.error("request %s: grammar rejected sampled token %d", request.request_id, token_id)
        return None
    return RequestStatus.FINISHED_STOPPED if grammar.is_terminated() else None
