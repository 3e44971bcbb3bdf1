"""The n-gram proposer (prompt lookup): if the context's last n tokens occurred earlier, guess that
what followed them then follows them now.

For each request, n runs from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the longest
suffix that occurred before wins, and among its occurrences the latest (the nearest text is the
likeliest to be copied again). The drafts are the up to k tokens after that occurrence; when the
occurrence ends so close to the end that fewer than k follow, the text is read as repeating with
the period (distance) between the two occurrences, which continues a loop such as ``a b c a b c``
past the context's end.

Pure numpy over the persistent batch's token array: one comparison pass per n, no Python loop
over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sparrow.spec_decode.config import SpeculativeConfig
from sparrow.spec_decode.proposer import SpecProposer


class NgramProposer(SpecProposer):
    def __init__(self, spec_config: SpeculativeConfig, model_runner: Any) -> None:
        super().__init__(spec_config, model_runner)
        self.min_n = spec_config.prompt_lookup_min or 1
        self.max_n = spec_config.prompt_lookup_max or self.min_n

    def propose(self, rows: Sequence[int], token_ids: np.ndarray, num_tokens: np.ndarray,
                hidden_states: Any = None) -> list[list[int]]:
        return [propose_ngram(token_ids[row, : int(num_tokens[row])], self.min_n, self.max_n,
                              self.num_speculative_tokens) for row in rows]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` drafts to follow ``tokens`` [L], or [] when no suffix of ``min_n``..``max_n``
    tokens occurred earlier."""
    length = tokens.shape[0]
    if length < min_n + 1 or k < 1:
        return []
    # matches[e]: tokens ending at e (e < L - 1) equal the context's last n tokens, for the n so far.
    matches = tokens[: length - 1] == tokens[length - 1]
    best_end = -1
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            # One more token back: position e - (n - 1) must equal position L - n.
            shift = n - 1
            matches[shift:] &= tokens[: length - 1 - shift] == tokens[length - n]
            matches[:shift] = False
        ends = np.flatnonzero(matches)
        if ends.size == 0:
            break  # a longer suffix cannot occur where a shorter one does not
        if n >= min_n:
            best_end = int(ends[-1])
    if best_end < 0:
        return []
    period = length - 1 - best_end
    start = best_end + 1
    # tokens[start + i] for i < period is known context; past it the text repeats with ``period``.
    available = tokens[start : start + min(k, period)].tolist()
    while len(available) < k:
        available.append(available[len(available) - period])
    return available
