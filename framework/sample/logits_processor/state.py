"""The worker's enabled processors as one pipeline, and batch updates computed from row layouts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sparrow.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
)


class LogitsProcessors:
    """Every processor of one worker, split by argmax invariance, in the order given (the
    built-ins first). The sampler calls ``apply_non_argmax_invariant`` on the masked logits
    before the penalties and ``apply_argmax_invariant`` after temperature."""

    def __init__(self, processors: Sequence[LogitsProcessor] = ()) -> None:
        self.all = list(processors)
        self.non_argmax_invariant = [p for p in self.all if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in self.all if p.is_argmax_invariant()]

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for processor in self.all:
            processor.update_state(batch_update)

    def apply_non_argmax_invariant(self, logits: torch.Tensor, owned: bool) -> torch.Tensor:
        """``owned``: False when ``logits`` is still the caller's tensor, which a processor that
        works in place must not touch (it gets a copy, made once)."""
        return _apply(self.non_argmax_invariant, logits, owned)

    def apply_argmax_invariant(self, logits: torch.Tensor, owned: bool) -> torch.Tensor:
        return _apply(self.argmax_invariant, logits, owned)


def _apply(processors: list[LogitsProcessor], logits: torch.Tensor, owned: bool) -> torch.Tensor:
    for processor in processors:
        # The built-ins declare that they never write into their input (they return new tensors
        # only for the rows they change), which saves a [B, V] copy per step.
        if not owned and not getattr(processor, "out_of_place", False):
            logits = logits.clone()
            owned = True
        result = processor.apply(logits)
        if result is not logits:
            owned = True
        logits = result
    return logits


def layout_update(
    previous: Sequence[Any],
    current: Sequence[Any],
    describe: Callable[[int, Any], AddedRequest],
) -> BatchUpdate | None:
    """The ``BatchUpdate`` that turns the row layout ``previous`` into ``current``.

    Rows hold per-request objects compared by identity (a request that leaves and comes back gets
    a new object, so it is removed and added, never moved); ``describe(row, obj)`` gives an added
    row's tuple. None when nothing changed.
    """
    previous_rows = {id(obj): row for row, obj in enumerate(previous)}
    current_ids = {id(obj) for obj in current}
    removed = [row for row, obj in enumerate(previous) if id(obj) not in current_ids]
    moves: dict[int, int] = {}  # src -> dst
    added: list[AddedRequest] = []
    for row, obj in enumerate(current):
        src = previous_rows.get(id(obj))
        if src is None:
            added.append(describe(row, obj))
        elif src != row:
            moves[src] = row
    if not removed and not moves and not added:
        return None
    return BatchUpdate(batch_size=len(current), removed=removed, moved=_ordered_moves(moves), added=added)


def _ordered_moves(moves: dict[int, int]) -> list[MovedRequest]:
    """``src -> dst`` moves as a sequence that is correct applied one by one: a move waits until
    its destination has been vacated; a cycle (which swap-removal never makes, but a general
    layout can) is broken with a SWAP."""
    ordered: list[MovedRequest] = []
    pending = dict(moves)
    while pending:
        ready = [src for src, dst in pending.items() if dst not in pending]
        if ready:
            for src in ready:
                ordered.append((src, pending.pop(src), MoveDirectionality.UNIDIRECTIONAL))
            continue
        # Every destination is still occupied by a request waiting to move: a cycle.
        src = next(iter(pending))
        dst = pending.pop(src)
        ordered.append((src, dst, MoveDirectionality.SWAP))
        # dst's request now sits in src and still has to reach its own destination.
        onward = pending.pop(dst)
        if onward != src:
            pending[src] = onward
    return ordered


def full_update(
    previous_size: int,
    params: Sequence[Any],
    prompt_token_ids: Sequence[list[int]],
    output_token_ids: Sequence[list[int]],
) -> BatchUpdate:
    """Every previous row removed and every row added: for callers that do not track layouts."""
    added = [(row, p, prompt, output)
             for row, (p, prompt, output) in enumerate(zip(params, prompt_token_ids, output_token_ids))]
    return BatchUpdate(batch_size=len(params), removed=list(range(previous_size)), moved=[], added=added)
