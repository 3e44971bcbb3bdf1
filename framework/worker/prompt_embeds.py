"""A step's prompt embeddings (vLLM's enable_prompt_embeds), gathered for the model's forward.

A request whose prompt came as embeddings keeps them in its ``CachedRequestState``; each step
that computes some of its prompt positions hands the model those rows and their flat positions in
the step, and the model puts them in place of the token embeddings
(``sparrow.layers.embedding.with_prompt_embeds``). Output tokens are embedded as usual.
"""

from __future__ import annotations

import numpy as np
import torch

from sparrow.worker.input_batch import InputBatch


def step_prompt_embeds(batch: InputBatch, req_ids: set[str], num_scheduled: np.ndarray,
                       query_start_loc: np.ndarray, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat positions [K] int64, rows [K, hidden]) on ``device`` for the prompt positions of
    ``req_ids`` this step computes, read before the step's tokens count as computed; None when
    the step has none. A request whose prompt this step completes leaves ``req_ids`` (a resumed
    request comes back with NewRequestData), so later steps do not look at it."""
    positions, rows, done = [], [], []
    for req_id in req_ids:
        row = batch.req_id_to_row.get(req_id)
        if row is None:  # not scheduled this step
            continue
        embeds = batch.states[row].prompt_embeds
        start = int(batch.num_computed_tokens[row])
        stop = min(start + int(num_scheduled[row]), int(embeds.shape[0]))
        if start < stop:
            first = int(query_start_loc[row])
            positions.append(torch.arange(first, first + stop - start, dtype=torch.int64))
            rows.append(embeds[start:stop])
        if stop == int(embeds.shape[0]):
            done.append(req_id)
    req_ids.difference_update(done)
    if not rows:
        return None
    return torch.cat(positions).to(device, non_blocking=True), torch.cat(rows).to(device, non_blocking=True)
