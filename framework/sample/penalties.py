"""Repetition, frequency and presence penalties, applied at the tokens a row has seen only.

A penalty changes the logits of the tokens in a row's prompt or output and no others, so instead
of [B, V] count and mask tensors (several passes over the whole vocabulary per step) this works on
the [B, L] padded id tensors: sort each row's ids, count the runs of equal ids, gather the logits
at those ids, penalise, scatter back. The arithmetic is the reference's, term for term
(``(x penalised) - f * count - p * 1``), so the values are bit for bit those of the dense version.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparrow.sample.metadata import SamplingMetadata, pad_token_ids


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM / OpenAI semantics), out of place.

    repetition: a token seen in the prompt or the output has its logit divided by the penalty when
    positive and multiplied by it when negative (penalty > 1 discourages repeats).
    frequency: logit -= penalty * (times the token appears in the output).
    presence: logit -= penalty * (1 if the token appears in the output at all).
    """
    repetition = metadata.repetition_penalties
    frequency = metadata.frequency_penalties
    presence = metadata.presence_penalties
    if repetition is None and frequency is None and presence is None:
        return logits
    vocab_size = logits.shape[1]
    output_ids = metadata.output_token_tensor  # [B, L] padded with vocab_size
    if output_ids is None:
        output_ids = pad_token_ids(metadata.output_token_ids, vocab_size, logits.device)
    result = logits.clone()
    if repetition is not None:
        penalty = repetition.unsqueeze(1)  # [B, 1]
        seen = output_ids
        if metadata.prompt_token_ids is not None:
            seen = torch.cat([metadata.prompt_token_ids, output_ids], dim=1)

        def repeat(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return torch.where(values > 0, values / penalty, values * penalty)

        _update_at_ids(result, seen, repeat)
    if frequency is not None or presence is not None:

        def output(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            if frequency is not None:
                values = values - frequency.unsqueeze(1) * counts
            if presence is not None:
                values = values - presence.unsqueeze(1)  # * 1: the token is present
            return values

        _update_at_ids(result, output_ids, output)
    return result


def _update_at_ids(
    logits: torch.Tensor, ids: torch.Tensor, update: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    """``logits[r, t] = update(logits[r, t], count of t in ids[r])`` for every distinct id t of row
    r, in place; ``ids``: [B, L] padded with V (the logits' width).

    Every write to a column carries the same value (duplicates of an id compute the same thing),
    so the scatter is deterministic on every device. Padding entries write to their row's first id
    with that id's count and value: the same write again; a row of padding alone writes column 0's
    own value back."""
    if ids.shape[1] == 0:
        return
    vocab_size = logits.shape[1]
    ids, _ = ids.sort(dim=1)  # padding (= V) last
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run = starts.cumsum(dim=1) - 1  # [B, L] the run of equal ids each entry belongs to
    run_lengths = torch.zeros_like(ids).scatter_add_(1, run, torch.ones_like(ids))
    counts = run_lengths.gather(1, run)  # [B, L] how often each entry's id occurs in its row
    padding = ids == vocab_size
    first = ids[:, :1]
    empty = first == vocab_size  # [B, 1] rows with no ids at all
    targets = torch.where(padding, first, ids).masked_fill(empty, 0)
    counts = torch.where(padding, counts[:, :1], counts).to(logits.dtype)
    values = logits.gather(1, targets)
    logits.scatter_(1, targets, torch.where(empty, values, update(values, counts)))
