"""The scheduler's bookkeeping for speculative decoding. Pure Python.

The drafts a worker proposed for a request (``ModelRunnerOutput.spec_token_ids``) wait here until
the next ``schedule()``, which counts them in the request's tokens for that step: ``1 + k`` tokens
of budget and KV slots. The scheduled tokens count as computed at once (as every scheduled token
does); when the step comes back with ``1 + a`` tokens (a accepted drafts), the ``k - a`` rejected
ones are taken off ``num_computed_tokens`` again. Their blocks stay with the request (the next
steps write over those slots), and the prefix cache never indexes them: ``allocate_slots``
caches only blocks full of the request's own tokens, and drafts are never among those.
"""

from __future__ import annotations

from sparrow.core.request import Request


class SpecDecodeStats:
    """Cumulative counters (``SchedulerStats.spec_decode_*``), never reset."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted_tokens):
            per_pos[position] += 1


def usable_drafts(request: Request, drafts: list[int], max_model_len: int) -> list[int]:
    """``drafts`` cut to what the request can still use: all accepted plus the token after them
    must stay within ``max_tokens`` and ``max_model_len``, so at most ``remaining - 1``; with a
    grammar, to the longest prefix it accepts (each verified position is masked by the grammar,
    so a later draft could never be accepted and would only waste budget and KV slots)."""
    room = min(request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens) - 1
    if room <= 0:
        return []
    drafts = drafts[:room] if len(drafts) > room else drafts
    if drafts and request.structured_output is not None:
        drafts = request.structured_output.validate_tokens(drafts)
    return drafts
