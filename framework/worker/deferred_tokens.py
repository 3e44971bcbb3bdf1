"""Sampled tokens that stay on the device: step n feeds step n+1 without a host round trip.

With overlapped scheduling the worker is handed step n+1 while step n still runs. If step n ended
by copying its sampled tokens to the host (``.tolist()``), the worker would wait for the device
there, and the device would then wait for the worker to prepare step n+1. Instead:

1. Step n samples, starts a non-blocking copy of the tokens into a pinned buffer, records an
   event, and returns a :class:`DeferredStepOutput` at once. The engine core's thread calls
   :meth:`DeferredStepOutput.result`, which waits for that event alone.
2. Step n+1 prepares its inputs from the host batch, whose rows lack step n's tokens; the
   position of each such token is filled on the device from step n's sampled tensor
   (:meth:`PendingTokens.feed`), in stream order after step n's sampler.
3. Once step n+1's forward is enqueued, the worker appends step n's tokens to its host state
   (:meth:`PendingTokens.settle`), before step n+1's sampler reads the output histories
   (penalties, logits processors). Waiting there costs the device nothing: it has step n+1's
   forward to run.

Where the next step is not a plain continuation of every pending request (one was left out of
the step, or scheduled with more than one token), the worker settles first and takes the host
path: slower for that step, never different tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sparrow.core.sched.output import SchedulerOutput
from sparrow.sample.logprobs import LogprobsTensors
from sparrow.worker.outputs import ModelRunnerOutput, TokenLogprobs

# Pinned host buffers for the copies: step n's is read by the engine core (result) and by step
# n+1 (settle); at most two steps are in flight, so four never overlap.
_RING = 4


class TokenCopies:
    """A ring of pinned host buffers and events for the sampled-token copies (CUDA); on the CPU
    the sampled tensor is its own host copy."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.device = device
        self.max_num_reqs = max_num_reqs
        self._next = 0
        self._buffers: list[torch.Tensor] = []  # made on first use (only overlapped steps copy)
        self._events: list[Any] = []

    def start(self, sampled: torch.Tensor, logprobs: LogprobsTensors | None = None
              ) -> tuple[torch.Tensor, Any, LogprobsTensors | None]:
        """Begin copying ``sampled`` [R] (and the step's logprobs, if any) to the host: ``(host
        tensor, event or None, host logprobs)``. Reading them after the event never waits for
        later steps, as a plain ``.tolist()`` from another thread would (it syncs the stream)."""
        if self.device.type != "cuda":
            return sampled, None, logprobs
        if not self._buffers:
            with torch.inference_mode(False):
                self._buffers = [torch.zeros(self.max_num_reqs, dtype=torch.int64, pin_memory=True)
                                 for _ in range(_RING)]
            self._events = [torch.cuda.Event() for _ in range(_RING)]
        index, self._next = self._next, (self._next + 1) % _RING
        host = self._buffers[index][: sampled.shape[0]]
        host.copy_(sampled, non_blocking=True)
        if logprobs is not None:
            logprobs = LogprobsTensors(*(_pinned_copy(t) for t in (logprobs.token_ids, logprobs.logprobs,
                                                                  logprobs.ranks)))
        event = self._events[index]
        event.record()
        return host, event, logprobs


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy into pinned host memory (torch's caching host allocator keeps the
    block until the copy ran)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class PendingTokens:
    """Step n's tokens of the rows that sampled one, not yet in the worker's host state."""

    __slots__ = ("sampled", "host", "event", "states", "rows", "_tokens")

    def __init__(self, sampled: torch.Tensor, host: torch.Tensor, event: Any, states: list[Any],
                 rows: np.ndarray) -> None:
        self.sampled = sampled  # [R] on the device: every row of step n
        self.host = host  # its host copy, valid once ``event`` completed
        self.event = event
        self.states = states  # CachedRequestState of each row that sampled
        self.rows = rows  # [len(states)] int64: their rows in step n
        self._tokens: list[int] | None = None

    def tokens(self) -> list[int]:
        """Every row's token of step n (waits for the copy; both threads may ask)."""
        tokens = self._tokens
        if tokens is None:
            if self.event is not None:
                self.event.synchronize()
            tokens = self._tokens = self.host.tolist()
        return tokens

    def continues_in(self, so: SchedulerOutput) -> bool:
        """Whether step ``so`` can be fed on the device: it has tokens, and every pending request
        it schedules gets exactly its pending token. A request the step leaves out loses its row
        and gets its token in its host state during the step, before it can come back; a finished
        or resumed request's old state is dropped."""
        if so.total_num_scheduled_tokens == 0:
            return False
        scheduled = so.num_scheduled_tokens
        resumed = {new.req_id for new in so.scheduled_new_reqs} if so.scheduled_new_reqs else ()
        for state in self.states:
            count = scheduled.get(state.req_id)
            if count is not None and count != 1 and state.req_id not in resumed:
                return False
        return True

    def feed(self, batch: Any, input_ids: torch.Tensor, query_start_loc: np.ndarray, to_device: Any) -> str:
        """Write each continuing request's pending token into this step's ``input_ids`` (at its
        row's first token) on the device. Returns how: "identity" (the same rows in the same
        order, one slice copy), "indexed" (one gather and scatter) or "none"."""
        dst, src = [], []
        req_id_to_row, batch_states = batch.req_id_to_row, batch.states
        for state, old_row in zip(self.states, self.rows.tolist()):
            row = req_id_to_row.get(state.req_id)
            if row is not None and batch_states[row] is state:
                dst.append(int(query_start_loc[row]))
                src.append(old_row)
        if not dst:
            return "none"
        num = len(dst)
        sampled = self.sampled if self.sampled.dtype == input_ids.dtype else self.sampled.to(input_ids.dtype)
        if dst == src == list(range(num)):  # a steady decode batch: the same rows, in order
            input_ids[:num].copy_(sampled[:num])
            return "identity"
        index = to_device(np.array([dst, src], dtype=np.int64))
        input_ids.index_copy_(0, index[0], sampled.index_select(0, index[1]))
        return "indexed"

    def settle(self, batch: Any) -> None:
        """Append the tokens to the worker's host state: each request's output list, and its
        batch row where the request still holds one."""
        tokens = self.tokens()
        req_id_to_row, batch_states = batch.req_id_to_row, batch.states
        for state, old_row in zip(self.states, self.rows.tolist()):
            token_id = tokens[old_row]
            state.output_token_ids.append(token_id)
            row = req_id_to_row.get(state.req_id)
            if row is not None and batch_states[row] is state:
                batch.append_token(row, token_id)


def sampled_lists(req_ids: list[str], rows: list[int], tokens: list[int],
                  logprobs_rows: list[TokenLogprobs | None] | None
                  ) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
    """A plain step's ``sampled_token_ids`` and ``logprobs``: ``tokens[row]`` for each of ``rows``
    (the rows that sampled), nothing for the others (partial prefills)."""
    sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
    logprobs: dict[str, list[TokenLogprobs]] = {}
    for row in rows:
        sampled_token_ids[row] = [tokens[row]]
        entry = logprobs_rows[row] if logprobs_rows is not None else None
        if entry is not None:
            logprobs[req_ids[row]] = [entry]
    return sampled_token_ids, logprobs


class DeferredStepOutput:
    """A step's :class:`ModelRunnerOutput` once its sampled tokens reach the host: ``result()``,
    called by whoever collects the step (the engine core's thread)."""

    def __init__(self, req_ids: list[str], pending: PendingTokens, sampler_output: Any,
                 prompt_logprobs: dict[str, list[TokenLogprobs]]) -> None:
        self.req_ids = req_ids
        self.pending = pending
        self.sampler_output = sampler_output
        self.prompt_logprobs = prompt_logprobs

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting for the device."""
        event = self.pending.event
        return event is None or event.query()

    def result(self) -> ModelRunnerOutput:
        sampled_token_ids, logprobs = sampled_lists(self.req_ids, self.pending.rows.tolist(), self.pending.tokens(),
                                                    self.sampler_output.logprobs_lists())
        return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled_token_ids, logprobs=logprobs,
                                 prompt_logprobs=self.prompt_logprobs)
