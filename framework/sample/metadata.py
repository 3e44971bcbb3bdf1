"""Per-step sampling inputs, laid out as device tensors with one row per request in batch order.

A model runner builds a ``SamplingMetadata`` from the requests' ``SamplingParams`` and hands it to
the ``Sampler`` with the step's logits. Two ways to build it:

* ``build_sampling_metadata(...)``: from scratch, every step (simple, always correct);
* ``SamplingTensors``: for a persistent batch. ``update_batch`` is called when the set or order of
  requests changes and rebuilds the per-request tensors; ``metadata`` is called every step and only
  refreshes what moves with each generated token (output tokens, the seeded rows' uniforms) and
  passes the batch's changes to the logits processors (``sparrow.sample.logits_processor``: the
  built-ins allowed_token_ids, bad_words, min_tokens, logit_bias, and any a plugin enables).

Seeding: a seeded request must sample the same tokens whatever else is in the batch and however
often it was preempted and recomputed. So nothing carries state from one step to the next: the
metadata carries, for each seeded row, one uniform number derived from ``step_seed(seed,
num_output_tokens)`` (the position of the token about to be sampled), and the sampler draws that
row's token by inverting the row's distribution at it. All seeded rows are drawn in one batched
operation: no per-row generator, no per-row kernel launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from sparrow.sample.history import OutputHistory
from sparrow.sample.logits_processor.interface import BatchUpdate
from sparrow.sample.logits_processor.load import builtin_logits_processors
from sparrow.sample.logits_processor.state import LogitsProcessors, full_update
from sparrow.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5
_UINT64_MASK = (1 << 64) - 1


@dataclass(slots=True)
class SamplingMetadata:
    """What the sampler needs for one step. Tensors live on the logits' device; B = batch size."""

    # [B] float32; rows with temperature < 1e-5 are greedy (the sampler takes their argmax).
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [B] int64, 0 = no top-k for that row; None when no row uses top-k.
    top_k: torch.Tensor | None
    # [B] float32, 1.0 = off; None when no row uses top-p.
    top_p: torch.Tensor | None
    # [B] float32, 0.0 = off; None when no row uses min-p.
    min_p: torch.Tensor | None
    # [B] float32 each; None when every row is neutral (0, 0 and 1 respectively).
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # Per row, the tokens generated so far (lists are shared with the caller, not copied).
    output_token_ids: list[list[int]]
    # [B, max_prompt_len] int64 padded with ``vocab_size``; only when a repetition penalty is set.
    prompt_token_ids: torch.Tensor | None
    # Logits width; token id ``vocab_size`` is the padding of the padded id tensors.
    vocab_size: int
    # Seeded, non-greedy rows: [S] int64 row indices and [S] uniforms in [0, 1) (float64, see sum_dtype), one per
    # row from step_seed(seed, position) (see step_uniform); None when no row is seeded.
    seeded_rows: torch.Tensor | None = None
    seeded_uniforms: torch.Tensor | None = None
    # The worker's logits processors, already told this step's batch changes; None: none run.
    logits_processors: LogitsProcessors | None = None
    # Per row, how many top logprobs it asked for (None = no logprobs); max over rows or None.
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None
    # Structured outputs: (rows [G] int64, bitmask [G, ceil(V / 32)] int32) where bit j of word w
    # allows token 32 * w + j in that row; None when no row samples under a grammar this step.
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    # ``output_token_ids`` as [B, max_len] int64 padded with ``vocab_size``, kept on the device
    # between steps (``OutputHistory``); only when a penalty is set. None: the sampler pads the lists.
    output_token_tensor: torch.Tensor | None = None
    # [R] int64: the rows that asked for logprobs when only some did (the sampler computes
    # logprobs for those rows alone); None when every row or no row asked.
    logprob_rows: torch.Tensor | None = None
    # The largest top-k of the batch when every row that filters (top-k or top-p) has a top-k:
    # the sampler then finds each row's cut among the top max_top_k logits instead of sorting the
    # whole vocabulary. None: some row needs the full sort, or no row filters.
    max_top_k: int | None = None
    # vLLM's logprob_token_ids: per row, the token ids whose logprobs it also asked for (None: none);
    # None when no row did.
    logprob_token_ids: list[list[int] | None] | None = None


def step_seed(seed: int, position: int) -> int:
    """Mix a request's seed with the position of the token being sampled into a 64-bit seed.

    A splitmix64 finaliser over ``seed`` and ``position``, so that neighbouring seeds and positions
    give unrelated streams. Pure integer arithmetic: identical in every process and on every device.
    """
    value = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB)
    value &= _UINT64_MASK
    value ^= value >> 30
    value = (value * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    value ^= value >> 27
    value = (value * 0x94D049BB133111EB) & _UINT64_MASK
    value ^= value >> 31
    return value


def sum_dtype(device: torch.device | str) -> torch.dtype:
    """float64 for the sampler's sums and uniforms where the device has it (CPU, CUDA); float32
    elsewhere (some accelerators lack float64), at the cost of tokens below ~1e-7 probability."""
    return torch.float64 if torch.device(device).type in ("cpu", "cuda") else torch.float32


def step_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) for a seeded row's draw at ``position``: the top 53 bits of
    ``step_seed``, exactly representable in float64."""
    return (step_seed(seed, position) >> 11) / float(1 << 53)


def step_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``step_uniform`` of many (seed, position) pairs at once: the same splitmix64 in numpy
    uint64 arithmetic, which wraps modulo 2**64 as the masks above do, so every value is bit for
    bit ``step_uniform``'s. ``seeds``: uint64 (a seed taken modulo 2**64); ``positions``: int."""
    value = (seeds * np.uint64(0x9E3779B97F4A7C15) + positions.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
             + np.uint64(0x94D049BB133111EB))
    value ^= value >> np.uint64(30)
    value *= np.uint64(0xBF58476D1CE4E5B9)
    value ^= value >> np.uint64(27)
    value *= np.uint64(0x94D049BB133111EB)
    value ^= value >> np.uint64(31)
    # The top 53 bits convert to float64 exactly; the power-of-two division is exact too.
    return (value >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def pad_token_ids(
    token_ids: list[list[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """Lists of ids -> [len(token_ids), max_len] int64 on ``device``, padded with ``pad_id``."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    # One tensor from one nested list: far cheaper than a tensor per row.
    rows = [list(ids) + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    padded = torch.tensor(rows, dtype=torch.int64).reshape(len(token_ids), max_len)
    return padded.to(device, non_blocking=True)


def _static_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """The parts that depend only on which requests sit in which row."""
    greedy = [p.temperature < _SAMPLING_EPS for p in params]

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    def column_if(values: list, neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
        if all(value == neutral for value in values):
            return None
        return column(values, dtype)

    # top_k 0 is "off"; a top_k at or past the vocabulary is off too.
    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    # Greedy rows never reach the filters, so their filter settings are neutralised: a batch of
    # greedy rows with top_p set should not pay for a sort.
    top_k = [0 if g else k for g, k in zip(greedy, top_k)]
    top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
    min_p = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
    repetition = [p.repetition_penalty for p in params]
    repetition_penalties = column_if(repetition, 1.0, torch.float32)
    num_logprobs = [p.logprobs for p in params]
    asked = [k for k in num_logprobs if k is not None]
    logprob_rows = None
    if asked and len(asked) < len(params):
        logprob_rows = column([row for row, k in enumerate(num_logprobs) if k is not None], torch.int64)
    # Rows that filter; the window path needs a k in each of them (a row with top-p alone needs
    # its whole sorted row).
    filtering = [(k, p) for k, p in zip(top_k, top_p) if k > 0 or p < 1.0]
    max_top_k = max(k for k, _ in filtering) if filtering and all(k > 0 for k, _ in filtering) else None
    return SamplingMetadata(
        temperature=column([p.temperature for p in params], torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=column_if(top_k, 0, torch.int64),
        top_p=column_if(top_p, 1.0, torch.float32),
        min_p=column_if(min_p, 0.0, torch.float32),
        presence_penalties=column_if([p.presence_penalty for p in params], 0.0, torch.float32),
        frequency_penalties=column_if([p.frequency_penalty for p in params], 0.0, torch.float32),
        repetition_penalties=repetition_penalties,
        output_token_ids=[],
        prompt_token_ids=(
            pad_token_ids(prompt_token_ids, vocab_size, device)
            if repetition_penalties is not None
            else None
        ),
        vocab_size=vocab_size,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(asked) if asked else None,
        logprob_rows=logprob_rows,
        max_top_k=max_top_k,
        logprob_token_ids=[p.logprob_token_ids for p in params] if any(p.logprob_token_ids for p in params) else None,
    )


class SamplingTensors:
    """Sampling state of a persistent batch: rebuilt on batch changes, refreshed every step.

    Usage by a model runner::

        tensors = SamplingTensors(vocab_size, device, logits_processors)
        # whenever requests were added, removed or reordered:
        tensors.update_batch(params_in_row_order, prompt_ids_in_row_order, batch_update)
        # every step, with each row's output token list (the same list objects may be reused):
        metadata = tensors.metadata(output_ids_in_row_order)

    ``batch_update`` tells the logits processors what changed (see
    ``sparrow.sample.logits_processor.interface``); without it they are told that every row was
    replaced, with the output lists of the next ``metadata`` call as the rows' live lists. The
    default processors are the built-ins.
    """

    def __init__(self, vocab_size: int, device: torch.device | str,
                 logits_processors: LogitsProcessors | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.logits_processors = (logits_processors if logits_processors is not None
                                  else builtin_logits_processors(device))
        self._static: SamplingMetadata | None = None
        self._params: list[SamplingParams] = []
        self._prompt_token_ids: list[list[int]] = []
        # Seeded random rows: their rows (a list and [S] int64 on the device) and seeds mod 2**64.
        self._seeded: list[int] = []
        self._seeds = np.zeros(0, dtype=np.uint64)
        self._seeded_rows: torch.Tensor | None = None
        # The output tokens on the device while some row has a penalty (None otherwise).
        self._history: OutputHistory | None = None
        # What the processors have not been told yet: a BatchUpdate, "everything" (True) or nothing.
        self._pending_update: BatchUpdate | bool | None = None
        self._processor_rows = 0  # batch size the processors last saw

    def update_batch(
        self, params: list[SamplingParams], prompt_token_ids: list[list[int]],
        batch_update: BatchUpdate | None = None,
    ) -> None:
        """Rebuild the per-request tensors; call when requests join, leave or change rows."""
        if len(params) != len(prompt_token_ids):
            raise ValueError(
                f"params and prompt_token_ids must have one entry per row, got "
                f"{len(params)} and {len(prompt_token_ids)}"
            )
        self._static = _static_metadata(params, prompt_token_ids, self.vocab_size, self.device)
        self._params, self._prompt_token_ids = list(params), list(prompt_token_ids)
        # Two updates the processors have not seen cannot be chained: replace every row instead.
        if batch_update is None or self._pending_update is not None:
            self._pending_update = True
        else:
            self._pending_update = batch_update
        self._seeded = [row for row, p in enumerate(params) if p.seed is not None and p.temperature >= _SAMPLING_EPS]
        self._seeds = np.array([(params[row].seed or 0) & _UINT64_MASK for row in self._seeded], dtype=np.uint64)
        seeded = self._seeded
        self._seeded_rows = torch.tensor(seeded, dtype=torch.int64).to(self.device) if seeded else None

    def metadata(self, output_token_ids: list[list[int]]) -> SamplingMetadata:
        """This step's metadata; ``output_token_ids[row]`` is what that row generated so far."""
        if self._static is None:
            raise RuntimeError("SamplingTensors.update_batch must be called before metadata")
        if len(output_token_ids) != self._static.temperature.shape[0]:
            raise ValueError(
                f"output_token_ids has {len(output_token_ids)} rows, the batch has "
                f"{self._static.temperature.shape[0]}"
            )
        pending, self._pending_update = self._pending_update, None
        # True: rebuild every row's state (the rows changed more than one update can say).
        update: BatchUpdate | None
        if pending is True:
            update = full_update(self._processor_rows, self._params, self._prompt_token_ids, output_token_ids)
        else:
            update = pending if isinstance(pending, BatchUpdate) else None
        if update is not None:
            self._processor_rows = update.batch_size
        self.logits_processors.update_state(update)
        seeded_uniforms = None
        if self._seeded:
            positions = np.fromiter((len(output_token_ids[row]) for row in self._seeded), dtype=np.int64,
                                    count=len(self._seeded))
            uniforms = torch.from_numpy(step_uniforms(self._seeds, positions))
            seeded_uniforms = uniforms.to(self.device, sum_dtype(self.device), non_blocking=True)
        static = self._static
        output_token_tensor = None
        if (static.repetition_penalties is not None or static.frequency_penalties is not None
                or static.presence_penalties is not None):
            if self._history is None:
                self._history = OutputHistory(self.vocab_size, self.device)
            output_token_tensor = self._history.update(output_token_ids)
        else:
            self._history = None  # no row needs it: free it (a later penalty reads the lists again)
        return dataclasses.replace(
            static,
            output_token_ids=output_token_ids,
            output_token_tensor=output_token_tensor,
            seeded_rows=self._seeded_rows if self._seeded else None,
            seeded_uniforms=seeded_uniforms,
            logits_processors=self.logits_processors,
        )


def build_sampling_metadata(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """One step's metadata from scratch; rows are in batch order in all three lists.

    ``output_token_ids[row]`` is what that request generated so far (its length is the position of
    the token to sample, which seeds the row's noise); ``prompt_token_ids`` is read only when some
    row sets a repetition penalty. ``vocab_size`` is the logits' width.
    """
    tensors = SamplingTensors(vocab_size, device)
    tensors.update_batch(params, prompt_token_ids)
    return tensors.metadata(output_token_ids)
