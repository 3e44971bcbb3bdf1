"""The sampler's logit filters: each returns new logits with -inf where a row may not draw.

* :func:`apply_grammar_bitmask`: tokens a row's grammar forbids (structured outputs);
* :func:`apply_min_p`: tokens below min_p times the row's top probability;
* :func:`apply_top_k_top_p`: tokens outside the row's top k and the smallest set holding p of the
  mass, ties kept together, without sorting the whole vocabulary where the cut is known to lie
  among a row's top few logits (the ``top_k_top_p`` function op's reference).

Batched torch, device-agnostic, out of place; ``sparrow.sample.sampler`` applies them in vLLM's
order.
"""

from __future__ import annotations

import torch


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf for every token the grammar of row ``rows[g]`` forbids (bit clear in ``bitmask[g]``),
    out of place; rows not listed are untouched.

    On CPU, xgrammar's C++ kernel (several times faster than unpacking the bits with tensor ops
    there); on any other device, plain torch ops, which its memory bandwidth makes cheap."""
    vocab_size = logits.shape[1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar

        masked = logits.clone()
        covered = min(vocab_size, bitmask.shape[1] * 32)
        # The kernel reads bitmask row i for logits row i: place the rows at their batch rows.
        by_row = torch.empty(logits.shape[0], bitmask.shape[1], dtype=torch.int32)
        by_row[rows] = bitmask
        xgrammar.apply_token_bitmask_inplace(masked, by_row, vocab_size=covered, indices=rows.tolist())
        if covered < vocab_size:  # ids past the grammar's vocabulary are never allowed
            masked[rows, covered:] = float("-inf")
        return masked
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [G, 32 * words]
    if allowed.shape[1] < vocab_size:  # ids past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    constrained = logits.index_select(0, rows)  # [G, V]
    constrained = constrained.masked_fill(~allowed[:, :vocab_size], float("-inf"))
    return logits.index_copy(0, rows, constrained)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability.

    ``min_p``: [B] with 0 for rows that do not use it (nothing is below 0).
    """
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose mass reaches p, per row.

    ``top_k``: [B] int, 0 = off; ``top_p``: [B] float, 1 = off. One ascending sort serves both.
    Ties are kept together: a row's cut is turned into a logit threshold, so every token equal to
    the last survivor survives too, whatever order the sort left the ties in. That may keep a few
    more than k tokens, never fewer, and never drops part of a tie.

    Sorting the whole vocabulary is avoided where the cut is known to lie among a row's top few
    logits (``_window_cut``, the same cut): ``max_top_k``, an upper bound on k known without
    reading the device, given when every row with k = 0 also has p = 1 (see
    ``SamplingMetadata.max_top_k``); or, on CPU where reading a tensor costs nothing, a window
    of ``_TOP_P_WINDOW`` tokens that is checked to hold every row's top-p cut.
    """
    vocab_size = logits.shape[1]
    if top_k is not None and max_top_k is not None and 4 * max_top_k < vocab_size:
        cut = _window_cut(logits, top_k, top_p, max_top_k)  # unchecked: never None
        if cut is not None:
            return cut
    if top_p is not None and logits.device.type == "cpu":
        window = max(_TOP_P_WINDOW, int(top_k.max()) if top_k is not None else 0)
        if 4 * window < vocab_size:
            cut = _window_cut(logits, top_k, top_p, window, checked=True)
            if cut is not None:
                return cut
    return _full_sort_cut(logits, top_k, top_p)


# The window tried for top-p rows without a top-k (CPU): at the usual temperatures the top 1024
# tokens hold far more than the usual p of the mass.
_TOP_P_WINDOW = 1024


def _full_sort_cut(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """``apply_top_k_top_p`` by sorting every row whole."""
    vocab_size = logits.shape[1]
    sorted_logits, _ = logits.sort(dim=-1)  # [B, V], ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        # The k-th largest sits at ascending position V - k.
        kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        cumulative = sorted_probs.cumsum(dim=-1)  # [B, V], last column ~1
        # Drop the low tail whose whole mass fits within 1 - p; the top token always stays.
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # The smallest surviving logit of each row is its threshold.
    threshold = sorted_logits.masked_fill(sorted_logits == float("-inf"), float("inf"))
    threshold = threshold.amin(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _window_cut(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, window: int,
                checked: bool = False) -> torch.Tensor | None:
    """``_full_sort_cut`` from each row's top ``window`` logits, for rows with 0 < k <= ``window``
    and rows that do not filter (k = 0, p = 1); with ``checked``, also rows with top-p alone, and
    None when one of those has its cut past the window (read on the host: a sync on a GPU).

    The same cut: the k-th largest logit comes from the window; for top-p, the ascending cumulative
    mass is the full sort's, because what lies outside the window sits below it in ascending order
    and is put first with its mass: for a row with a k, the ties of the k-th value past the window
    (the rest is below the k-th value: no mass); for a row without, all of it (exp of every logit).
    """
    rows = logits.shape[0]
    values = logits.topk(window + 1, dim=-1).values  # [B, W + 1], descending (W < V / 4)
    next_value = values[:, window:]  # [B, 1] the largest logit past the window
    values = values[:, :window]
    if top_k is not None:
        has_k = (top_k > 0).unsqueeze(1)  # [B, 1]
        kth = values.gather(1, (top_k.clamp(min=1, max=window) - 1).unsqueeze(1))  # [B, 1]
        kth = kth.masked_fill(~has_k, float("-inf"))
    else:
        has_k = torch.zeros(rows, 1, dtype=torch.bool, device=logits.device)
        kth = torch.full((rows, 1), float("-inf"), device=logits.device)
    if top_p is None:
        return logits.masked_fill(logits < kth, float("-inf"))
    p = top_p.unsqueeze(1)  # [B, 1]
    unfiltered = ~has_k & (p >= 1)
    top = values[:, :1]
    ascending = values.flip(-1)  # [B, W]
    mass = torch.exp(ascending - top).masked_fill(ascending < kth, 0.0)  # unnormalised survivors
    if logits.device.type == "cpu" and not bool(((next_value >= kth) & has_k).any()):
        outside = torch.zeros_like(kth)  # no row's k-th value goes on past the window: no ties to count
    else:
        # count_nonzero: a bool .sum() would first copy the [B, V] mask to int64.
        ties_past = torch.count_nonzero(logits >= kth, dim=-1) - torch.count_nonzero(values >= kth, dim=-1)
        outside = ties_past.unsqueeze(1) * torch.exp(kth - top)  # [B, 1]; 0 for rows without a k
    if checked:
        rest = torch.exp(logits - top).sum(dim=-1, keepdim=True) - mass.sum(dim=-1, keepdim=True)
        outside = torch.where(has_k, outside, rest.clamp(min=0))
    cumulative = outside + mass.cumsum(dim=-1)
    total = cumulative[:, -1:]
    if checked:
        # Every token past the window must be dropped (its mass fits within 1 - p) for the cut to
        # be inside the window.
        inside = has_k | unfiltered | (outside <= (1 - p) * total)
        if not bool(inside.all()):
            return None
    drop = (cumulative / total <= 1 - p) | (ascending < kth)
    drop[:, -1] = False
    threshold = ascending.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)  # [B, 1]
    threshold = threshold.masked_fill(unfiltered, float("-inf"))  # nothing is below -inf
    return logits.masked_fill(logits < threshold, float("-inf"))
