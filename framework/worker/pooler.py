"""The worker's pooling: one vector per prompt from the model's final hidden states.

A pooling engine (``runner="pooling"``, see :mod:`sparrow.pooling`) runs every prompt through
the model like a prefill, possibly in chunks over several steps, and samples nothing. When a
prompt's last token has been computed, its vector is returned in
``ModelRunnerOutput.pooler_output`` and the scheduler finishes the request:

    LAST  the final hidden state of the prompt's last token (decoder embedding models)
    MEAN  the mean over every prompt token (sums carried across chunks)
    CLS   the first token's

A classifier (``convert="classify"``) passes the pooled states through its ``score`` layer
(the ``head``), so its output is ``num_labels`` logits. A request with a token-level task
(``token_embed``, ``token_classify``; ``begin`` registers it) gets every prompt token's row
instead, its chunks kept until the prompt completes (the head applied to each chunk). The
frontend applies each request's ``dimensions`` and ``normalize``, or a classifier's activation
(sparrow.engine.pooling_io).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from sparrow.pooling_params import TOKEN_TASKS
from sparrow.worker.input_batch import InputBatch


class Pooler:
    def __init__(self, pooling_type: str, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.pooling_type = pooling_type
        self.head = head  # [N, hidden] -> [N, num_labels] (a classifier's score layer), or None
        # MEAN: req_id -> (float32 sum of the hidden states computed so far [hidden], their count)
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}
        # CLS: req_id -> the first token's hidden state, kept until the prompt completes
        self._first: dict[str, torch.Tensor] = {}
        # Token-level requests: req_id -> the rows computed so far, one tensor per chunk
        self._token_rows: dict[str, list[torch.Tensor]] = {}

    def begin(self, req_id: str, task: str | None) -> None:
        """A request the workers have just received (or that resumed): a token-level task gets
        every prompt token's row."""
        if task in TOKEN_TASKS:
            self._token_rows[req_id] = []

    def forget(self, req_ids: list[str]) -> None:
        """Drop what was carried for requests that finished, or were preempted (they start over)."""
        for req_id in req_ids:
            self._sums.pop(req_id, None)
            self._first.pop(req_id, None)
            self._token_rows.pop(req_id, None)

    def pool(self, hidden_states: torch.Tensor, batch: InputBatch, num_scheduled: np.ndarray,
             logits_indices: torch.Tensor, complete_rows: np.ndarray) -> dict[str, bytes]:
        """``hidden_states`` [T, hidden] of this step, rows in batch order; ``num_scheduled``
        [num_reqs] tokens of each row; ``logits_indices`` [num_reqs] each row's last token;
        ``complete_rows`` [num_reqs] whether the row's prompt completes this step. Returns
        req_id -> float32 bytes for the completed rows."""
        req_ids = batch.req_ids
        num_reqs = len(num_scheduled)
        pooled: dict[str, bytes] = {}
        token_level = np.array([req_id in self._token_rows for req_id in req_ids[:num_reqs]], dtype=bool) \
            if self._token_rows else np.zeros(num_reqs, dtype=bool)
        if token_level.any():
            self._token_level(hidden_states, req_ids, num_scheduled, complete_rows, token_level, pooled)
            complete_rows = complete_rows & ~token_level
        if self.pooling_type == "LAST":
            vectors = hidden_states[logits_indices[:num_reqs]]
        elif self.pooling_type == "MEAN":
            vectors = self._mean(hidden_states, req_ids, num_scheduled, complete_rows, token_level)
        else:
            vectors = self._cls(hidden_states, batch, req_ids, num_scheduled, complete_rows, token_level)
        rows = np.flatnonzero(complete_rows).tolist()
        if not rows:
            return pooled
        vectors = vectors[rows]
        if self.head is not None:
            vectors = self.head(vectors)
        host = vectors.to(device="cpu", dtype=torch.float32).numpy()
        self.forget([req_ids[row] for row in rows])
        pooled.update({req_ids[row]: host[position].astype("<f4").tobytes() for position, row in enumerate(rows)})
        return pooled

    def _token_level(self, hidden_states: torch.Tensor, req_ids: list[str], num_scheduled: np.ndarray,
                     complete_rows: np.ndarray, token_level: np.ndarray, pooled: dict[str, bytes]) -> None:
        """Keep this step's rows of each token-level request; a completed one's [prompt tokens,
        width] rows go into ``pooled``."""
        starts = np.concatenate(([0], np.cumsum(num_scheduled)[:-1])).tolist()
        for row in np.flatnonzero(token_level).tolist():
            chunks = self._token_rows[req_ids[row]]
            rows = hidden_states[starts[row]:starts[row] + int(num_scheduled[row])]
            # The head's output is new memory; bare hidden states live in a reused buffer.
            chunks.append(self.head(rows) if self.head is not None else rows.clone())
            if complete_rows[row]:
                values = torch.cat(chunks).to(device="cpu", dtype=torch.float32).numpy()
                pooled[req_ids[row]] = values.astype("<f4").tobytes()
                self.forget([req_ids[row]])

    def _mean(self, hidden_states: torch.Tensor, req_ids: list[str], num_scheduled: np.ndarray,
              complete_rows: np.ndarray, skip: np.ndarray) -> torch.Tensor:
        num_reqs, total = len(num_scheduled), int(num_scheduled.sum())
        # Each row's chunk summed in one pass: token t belongs to row row_of_token[t].
        row_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=hidden_states.device),
                                               torch.from_numpy(num_scheduled).to(hidden_states.device))
        sums = torch.zeros(num_reqs, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
        sums.index_add_(0, row_of_token, hidden_states[:total].float())
        means = torch.empty_like(sums)
        for row, req_id in enumerate(req_ids[:num_reqs]):
            if skip[row]:  # a token-level request's
                continue
            carried, count = self._sums.get(req_id, (None, 0))
            total_sum = sums[row] if carried is None else carried + sums[row]
            count += int(num_scheduled[row])
            if complete_rows[row]:
                means[row] = total_sum / count
            else:
                self._sums[req_id] = (total_sum, count)
        return means

    def _cls(self, hidden_states: torch.Tensor, batch: InputBatch, req_ids: list[str], num_scheduled: np.ndarray,
             complete_rows: np.ndarray, skip: np.ndarray) -> torch.Tensor:
        num_reqs = len(num_scheduled)
        starts = np.concatenate(([0], np.cumsum(num_scheduled)[:-1]))
        # The model runner has already counted this step's tokens as computed.
        first_positions = batch.num_computed_tokens[:num_reqs] - num_scheduled
        firsts = hidden_states[torch.from_numpy(starts).to(hidden_states.device)]
        vectors = torch.empty_like(firsts)
        for row, req_id in enumerate(req_ids[:num_reqs]):
            if skip[row]:  # a token-level request's
                continue
            first = firsts[row] if first_positions[row] == 0 else self._first.get(req_id)
            if first is None:  # cannot happen without a prefix-cache hit, which CLS pooling refuses
                raise RuntimeError(f"request {req_id!r}: its first token's hidden state was never computed")
            if complete_rows[row]:
                vectors[row] = first
            elif first_positions[row] == 0:
                self._first[req_id] = first.clone()
        return vectors
