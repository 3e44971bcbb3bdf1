"""The built-in processors: allowed_token_ids, bad_words, min_tokens, logit_bias and
thinking_token_budget.

Always enabled (registered by ``registration.py``). Each keeps ``row -> entry`` for the rows that
use it and rebuilds its index tensors only when those entries change (a row joins, leaves, moves,
or reaches min_tokens), at the next ``apply`` (when the logits' width is known); a batch without
such rows costs nothing per step. All of them mask or shift logits that need no other row, so
their order does not matter; none writes into its input (``out_of_place``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparrow.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, process_dict_updates
from sparrow.sampling_options import ThinkingMarkers
from sparrow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sparrow.config import EngineConfig

_NEG_INF = float("-inf")


class _RowIndexProcessor(LogitsProcessor):
    """Shared plumbing: per-row entries, a dirty flag, host-to-device index tensors."""

    out_of_place = True

    def __init__(self, config: EngineConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory and self.device.type != "cpu"
        self.rows: dict = {}
        self.dirty = False
        self.vocab_size = -1  # width the index tensors were built for
        self.neg_inf = torch.tensor(_NEG_INF, device=self.device)  # the value masked logits take

    def is_argmax_invariant(self) -> bool:
        return False  # each of them can change the greedy choice

    def to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self.pin_memory:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def stale(self, vocab_size: int) -> bool:
        """True (once) when the index tensors must be rebuilt for ``vocab_size``."""
        if not self.dirty and vocab_size == self.vocab_size:
            return False
        self.dirty, self.vocab_size = False, vocab_size
        return True


class AllowedTokenIdsLogitsProcessor(_RowIndexProcessor):
    """Rows with ``allowed_token_ids``: every other token gets -inf."""

    def __init__(self, config: EngineConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self.mask: torch.Tensor | None = None  # [B, V] bool, True where the row may not sample

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.rows, batch_update, lambda p, _prompt, _out: p.allowed_token_ids):
            self.dirty = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        num_rows, vocab_size = logits.shape
        # The batch can shrink or grow by rows without allowed_token_ids: the mask follows its height.
        if self.stale(vocab_size) or self.mask is None or self.mask.shape[0] != num_rows:
            mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
            for row, allowed in self.rows.items():
                mask[row] = True
                mask[row, torch.tensor(allowed, dtype=torch.int64)] = False
            self.mask = mask.to(self.device)
        return logits.masked_fill(self.mask, _NEG_INF)


class LogitBiasLogitsProcessor(_RowIndexProcessor):
    """Rows with ``logit_bias``: each listed token's logit is shifted by its bias."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.rows, batch_update, lambda p, _prompt, _out: p.logit_bias or None):
            self.dirty = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        if self.stale(logits.shape[1]):
            rows: list[int] = []
            token_ids: list[int] = []
            biases: list[float] = []
            for row, bias_by_token in self.rows.items():
                rows.extend([row] * len(bias_by_token))
                token_ids.extend(bias_by_token)
                biases.extend(float(bias) for bias in bias_by_token.values())
            self.index = (self.to_device(rows, torch.int64), self.to_device(token_ids, torch.int64))
            self.biases = self.to_device(biases, torch.float32)
        return logits.index_put(self.index, self.biases, accumulate=True)


def _stop_ids(params: SamplingParams) -> tuple[int, ...]:
    return tuple(sorted(set(params.stop_token_ids or ()) | set(params.all_stop_token_ids or ())))


class MinTokensLogitsProcessor(_RowIndexProcessor):
    """Rows short of ``min_tokens``: their EOS and stop token ids get -inf.

    A constrained request (structured outputs) is left alone: its grammar decides where it ends,
    and masking EOS where the grammar allows only EOS would leave nothing to sample.
    """

    @staticmethod
    def _entry(params: SamplingParams, _prompt: list[int], output_token_ids: list[int]):
        stop_ids = _stop_ids(params)
        if (params.min_tokens <= len(output_token_ids) or not stop_ids
                or params.structured_outputs is not None):
            return None
        return params.min_tokens, output_token_ids, stop_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.rows, batch_update, self._entry):
            self.dirty = True
        # A row leaves the mask once it has its min_tokens; the live output lists tell.
        reached = [row for row, (min_tokens, output, _) in self.rows.items() if len(output) >= min_tokens]
        for row in reached:
            del self.rows[row]
        self.dirty |= bool(reached)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        vocab_size = logits.shape[1]
        if self.stale(vocab_size):
            rows, token_ids = [], []
            for row, (_, _, stop_ids) in self.rows.items():
                # Ids past the logits' width cannot be sampled anyway; dropping them keeps indexing safe.
                kept = [token_id for token_id in stop_ids if token_id < vocab_size]
                rows.extend([row] * len(kept))
                token_ids.extend(kept)
            self.index = (self.to_device(rows, torch.int64), self.to_device(token_ids, torch.int64))
        return logits.index_put(self.index, self.neg_inf)


class BadWordsLogitsProcessor(_RowIndexProcessor):
    """Rows with ``bad_words``: a banned token-id sequence is never completed (vLLM's semantics).

    A one-token sequence is banned at every step. A longer one bans its last token only when the
    output so far ends with the sequence's other tokens; the prompt does not count. The one-token
    bans are indexed once per batch change; the longer ones are checked every step against the
    rows' live output lists.
    """

    @staticmethod
    def _entry(params: SamplingParams, _prompt: list[int], output_token_ids: list[int]):
        sequences = params.bad_words_token_ids
        if not sequences:
            return None
        single = sorted({ids[0] for ids in sequences if len(ids) == 1})
        multi = [(tuple(ids[:-1]), ids[-1]) for ids in sequences if len(ids) > 1]
        return single, multi, output_token_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.rows, batch_update, self._entry):
            self.dirty = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        vocab_size = logits.shape[1]
        if self.stale(vocab_size):
            self.static_rows: list[int] = []
            self.static_ids: list[int] = []
            for row, (single, _, _) in self.rows.items():
                kept = [token_id for token_id in single if token_id < vocab_size]
                self.static_rows.extend([row] * len(kept))
                self.static_ids.extend(kept)
            self.static_index = (self.to_device(self.static_rows, torch.int64),
                                 self.to_device(self.static_ids, torch.int64))
        rows, token_ids = [], []
        for row, (_, multi, output) in self.rows.items():
            for prefix, last in multi:
                if last < vocab_size and len(output) >= len(prefix) and tuple(output[-len(prefix):]) == prefix:
                    rows.append(row)
                    token_ids.append(last)
        index = self.static_index
        if rows:
            index = (self.to_device(self.static_rows + rows, torch.int64),
                     self.to_device(self.static_ids + token_ids, torch.int64))
        if index[0].numel() == 0:
            return logits
        return logits.index_put(index, self.neg_inf)


class _ThinkingRow:
    """One row's reasoning, read from its output as it grows: inside the reasoning or not, the
    tokens written there, and how much of the end marker has been forced."""

    __slots__ = ("budget", "start", "end", "output", "seen", "thinking", "count", "forced")

    def __init__(self, budget: int, markers: ThinkingMarkers, output: list[int]) -> None:
        self.budget, self.output, self.seen = budget, output, 0
        self.start, self.end = markers.start_token_ids, markers.end_token_ids
        self.thinking, self.count = markers.open_in_prompt, 0
        self.forced: int | None = None  # end-marker tokens forced so far, once the budget is spent

    def _ends_with(self, marker: list[int], length: int) -> bool:
        return bool(marker) and length >= len(marker) and self.output[length - len(marker):length] == marker

    def advance(self) -> None:
        """Read the output tokens that arrived since the last step."""
        for length in range(self.seen + 1, len(self.output) + 1):
            if not self.thinking:
                if self._ends_with(self.start, length):
                    self.thinking, self.count, self.forced = True, 0, None
            elif self._ends_with(self.end, length):
                self.thinking, self.forced = False, None
            elif self.forced is not None:
                self.forced += 1  # the forced token came out
            else:
                self.count += 1
        self.seen = len(self.output)
        if self.thinking and self.forced is None and self.count >= self.budget:
            self.forced = 0

    def forced_token(self) -> int | None:
        if self.thinking and self.forced is not None and self.forced < len(self.end):
            return self.end[self.forced]
        return None


class ThinkingBudgetLogitsProcessor(_RowIndexProcessor):
    """Rows with ``thinking_token_budget`` (vLLM's): once a row has written that many tokens inside
    its reasoning (after the start marker, in the output or left open by the prompt), its next
    tokens are the end marker's, forced one per step (every other logit -inf); the reasoning may
    also end by itself before. The markers come from the engine's reasoning parser
    (``SamplingParams.thinking_markers``, filled in by the input processor). Applied last, so a
    forced token stands whatever the other processors did."""

    @staticmethod
    def _entry(params: SamplingParams, _prompt: list[int], output_token_ids: list[int]):
        if params.thinking_token_budget is None or params.thinking_markers is None:
            return None
        return _ThinkingRow(params.thinking_token_budget, params.thinking_markers, output_token_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._entry)
        for state in self.rows.values():
            state.advance()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        forced = [(row, token) for row, state in self.rows.items()
                  if (token := state.forced_token()) is not None and token < logits.shape[1]]
        if not forced:
            return logits
        rows = self.to_device([row for row, _ in forced], torch.int64)
        tokens = self.to_device([token for _, token in forced], torch.int64)
        logits = logits.index_fill(0, rows, _NEG_INF)
        return logits.index_put((rows, tokens), torch.zeros((), dtype=logits.dtype, device=logits.device))


# Applied in this order (vLLM's, the thinking budget last); registered by name in registration.py.
BUILTIN_CLASSES: tuple[type[LogitsProcessor], ...] = (
    AllowedTokenIdsLogitsProcessor, BadWordsLogitsProcessor, MinTokensLogitsProcessor, LogitBiasLogitsProcessor,
    ThinkingBudgetLogitsProcessor,
)
