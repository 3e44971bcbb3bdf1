"""Parallel sampling (``n`` > 1): a request fans out into ``n`` engine-core requests of one
sequence each, and the output processor joins their outputs back into one ``RequestOutput``."""

from __future__ import annotations

import msgspec

from sparrow.errors import InvalidArgumentError
from sparrow.wire import EngineCoreRequest


def fan_out(request_id: str, n: int) -> list[str]:
    """Engine-core ids of the ``n`` child requests of a request with ``n`` > 1 samples."""
    if n < 1:
        raise InvalidArgumentError(f"n must be >= 1, got {n}", "n")
    return [f"{index}_{request_id}" for index in range(n)]


def make_child_requests(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """Split a request with ``n`` > 1 into ``n`` requests with ``n`` = 1 (itself when ``n`` = 1).

    The engine core only knows single sequences; the output processor joins the children back
    into one RequestOutput. A seeded request gives child ``i`` the seed ``seed + i``, so the
    samples differ from each other and are still reproducible.
    """
    params = request.sampling_params
    if params.n == 1:
        return [request]
    children = []
    for index, child_id in enumerate(fan_out(request.request_id, params.n)):
        seed = None if params.seed is None else params.seed + index
        child_params = params.clone(n=1, seed=seed)
        children.append(msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params))
    return children
