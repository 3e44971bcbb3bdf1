"""The logits-processor contract (vLLM v1's shape): a processor sees the batch change, then
transforms the logits of the whole batch once per step.

A worker builds each enabled processor once, at start-up, as ``cls(config, device, is_pin_memory)``.
Then, every step that samples, in this order:

1. ``update_state(batch_update)``: what changed in the batch since the previous call, or None when
   no request joined, left or changed rows (called every step, so that a processor whose state
   depends on the output tokens can look at them);
2. ``apply(logits)``: ``logits`` is [batch_size, vocab_size] float32, row i belonging to the
   request the updates placed in row i; return the transformed logits.

How Sparrow's batch changes (``sparrow.worker.input_batch``): rows are dense, 0..batch_size-1. A
request joining is appended at the end; a request leaving (finished, preempted, or not scheduled
this step) has its row filled by the last row, which moves down. A ``BatchUpdate`` is the net
change between two steps, to be processed in this order:

    removed  rows whose request left (indices in the previous layout)
    moved    (src, dst, MoveDirectionality) for requests that stay but change rows, in an order
             that is safe to apply one after the other (UNIDIRECTIONAL: src's request now sits in
             dst and src is free; SWAP: src and dst exchange requests)
    added    (row, SamplingParams, prompt_token_ids, output_token_ids) for requests that join

Moves come before additions (vLLM lists additions first): since a new request is appended, it
often lands on the row that a moving request has just left. ``output_token_ids`` is the
request's live list: the worker appends each sampled token to it, so a processor may keep the
reference and read it every step. A request that is preempted and resumed comes back as a new
addition (with the tokens it had generated).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

import torch

from sparrow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sparrow.config import EngineConfig


class MoveDirectionality(enum.IntEnum):
    UNIDIRECTIONAL = 0  # src's request moves to dst; src is left empty
    SWAP = 1  # src and dst exchange requests


# (row, params, prompt_token_ids, output_token_ids): output_token_ids is the live list.
AddedRequest = tuple[int, SamplingParams, list[int], list[int]]
# (src row, dst row, directionality)
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """The batch's net change since the previous ``update_state`` call (see the module docstring
    for the order: removed, moved, added)."""

    batch_size: int  # rows after the update
    removed: Sequence[int]
    moved: Sequence[MovedRequest]
    added: Sequence[AddedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor. Subclasses keep per-row state from ``update_state`` and
    transform every row that needs it in ``apply``; rows of requests that do not use the
    processor must be left as they are.

    ``apply`` may modify ``logits`` in place: the sampler hands it a tensor the sampler owns (the
    raw logits used for logprobs are a separate tensor), so logprobs stay the model's own.
    """

    def __init__(self, config: EngineConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        """Built once per worker. ``config`` is the engine's configuration (None when the sampler
        is used on its own, in tests); ``is_pin_memory`` says whether pinned host buffers may be
        used for host-to-device copies."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError, naming the field (``extra_args.NAME: ...``), for arguments this
        processor cannot honour. Called in the frontend for every request while the processor is
        enabled, before the request reaches the engine (a 400 on the server)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token has the largest logit (min-p style
        filters). Such processors run after temperature, only when some row samples at random;
        the others run before the penalties and affect greedy rows too."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Take the batch's changes (None: no change since the last call); called every step
        before ``apply``."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform ``logits`` [batch_size, vocab_size] float32 and return the result."""


T = TypeVar("T")


def process_dict_updates(
    rows: dict[int, T],
    batch_update: BatchUpdate | None,
    new_entry: Callable[[SamplingParams, list[int], list[int]], T | None],
) -> bool:
    """Apply ``batch_update`` to ``rows`` (row -> a processor's per-request entry), in the
    documented order; ``new_entry(params, prompt_token_ids, output_token_ids)`` gives an added
    request's entry, or None when the processor has nothing to do for it. True when ``rows``
    changed."""
    if batch_update is None:
        return False
    changed = False
    for row in batch_update.removed:
        changed |= rows.pop(row, None) is not None
    for src, dst, direction in batch_update.moved:
        moving = rows.pop(src, None)
        displaced = rows.pop(dst, None)
        if moving is not None:
            rows[dst] = moving
        if direction == MoveDirectionality.SWAP and displaced is not None:
            rows[src] = displaced
        changed |= moving is not None or displaced is not None
    for row, params, prompt_token_ids, output_token_ids in batch_update.added:
        entry = new_entry(params, prompt_token_ids, output_token_ids)
        replaced = rows.pop(row, None)
        if entry is not None:
            rows[row] = entry
        changed |= entry is not None or replaced is not None
    return changed

