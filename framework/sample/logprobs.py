"""Logprobs of chosen tokens plus the top-k alternatives, for sampled and prompt positions alike.

Kept as tensors (``LogprobsTensors``) until the worker builds its output, so a step pays a single
device-to-host copy for all rows; ``to_lists`` then makes the msgspec ``TokenLogprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.wire import TokenLogprobs


@dataclass(slots=True)
class LogprobsTensors:
    """Column 0 is the chosen token, columns 1..k the top-k in descending order; N rows."""

    token_ids: torch.Tensor  # [N, 1 + k] int64
    logprobs: torch.Tensor  # [N, 1 + k] float32
    ranks: torch.Tensor  # [N, 1 + k] int64, 1-based rank in the full distribution

    def placed_at(self, rows: torch.Tensor, num_rows: int) -> LogprobsTensors:
        """These N rows put at batch rows ``rows`` [N] of a ``num_rows``-row result; the other
        rows are zeros (rows that did not ask: ``to_lists`` never reads them)."""

        def place(values: torch.Tensor) -> torch.Tensor:
            placed = values.new_zeros((num_rows, values.shape[1]))
            return placed.index_copy_(0, rows, values)

        return LogprobsTensors(place(self.token_ids), place(self.logprobs), place(self.ranks))

    def to_lists(self, num_logprobs: list[int | None] | int) -> list[TokenLogprobs | None]:
        """One ``TokenLogprobs`` per row, cut to that row's k; None for rows that did not ask.

        ``num_logprobs`` is a per-row k (None = no logprobs) or one k for every row.
        """
        num_rows = self.token_ids.shape[0]
        per_row = [num_logprobs] * num_rows if isinstance(num_logprobs, int) else num_logprobs
        if len(per_row) != num_rows:
            raise ValueError(f"num_logprobs has {len(per_row)} entries, expected {num_rows}")
        token_ids = self.token_ids.cpu().tolist()
        logprobs = self.logprobs.cpu().tolist()
        ranks = self.ranks.cpu().tolist()
        result: list[TokenLogprobs | None] = []
        for row, k in enumerate(per_row):
            if k is None:
                result.append(None)
                continue
            width = 1 + k
            result.append(
                TokenLogprobs(
                    token_ids=token_ids[row][:width],
                    logprobs=logprobs[row][:width],
                    ranks=ranks[row][:width],
                )
            )
        return result


def gather_logprobs(logprobs: torch.Tensor, chosen_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Chosen token's logprob and rank, then the k most likely tokens, for each row.

    ``logprobs``: [N, V] normalised log-probabilities; ``chosen_ids``: [N] int.
    Ranks follow the OpenAI/vLLM meaning, 1 + the number of tokens with a strictly greater logprob,
    so tokens that tie share a rank (the top-k entries too, not just their position).
    """
    if k < 0:
        raise ValueError(f"k (number of top logprobs) must be >= 0, got {k}")
    if logprobs.dim() != 2 or chosen_ids.shape != (logprobs.shape[0],):
        raise ValueError(
            f"expected logprobs [N, V] and chosen_ids [N], got {tuple(logprobs.shape)} and "
            f"{tuple(chosen_ids.shape)}"
        )
    k = min(k, logprobs.shape[1])
    chosen_ids = chosen_ids.to(device=logprobs.device, dtype=torch.int64).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen_ids)  # [N, 1]
    chosen_ranks = (logprobs > chosen_logprobs).sum(dim=1, keepdim=True) + 1  # [N, 1]
    top_logprobs, top_ids = logprobs.topk(k, dim=1)  # [N, k], descending
    # Every token with a greater logprob than top entry i is itself among the entries before i,
    # so counting inside the top-k is exact: [N, k(i), k(j)] -> v_j > v_i, summed over j.
    top_ranks = (top_logprobs.unsqueeze(1) > top_logprobs.unsqueeze(2)).sum(dim=2) + 1
    return LogprobsTensors(
        token_ids=torch.cat([chosen_ids, top_ids], dim=1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=1).to(torch.float32),
        ranks=torch.cat([chosen_ranks, top_ranks], dim=1).to(torch.int64),
    )


def compute_token_logprobs(
    logprobs: torch.Tensor, chosen_ids: torch.Tensor, k: int
) -> list[TokenLogprobs]:
    """``TokenLogprobs`` for each of N positions: the chosen token, then the top k.

    Used for prompt logprobs, where row i is the distribution after prompt token i and the chosen
    token is prompt token i + 1. ``logprobs``: [N, V] (log_softmax of the logits); ``chosen_ids``:
    [N]. A caller with a long prompt should call this in chunks of positions, as [N, V] float32 is
    large.
    """
    lists = gather_logprobs(logprobs, chosen_ids, k).to_lists(k)
    return [entry for entry in lists if entry is not None]
