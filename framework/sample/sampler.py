"""The sampler: logits [B, V] + SamplingMetadata -> one token per row (and its logprobs).

The order follows vLLM V1:

1. logprobs for the output come from the raw logits (the model's own distribution);
2. tokens a row's grammar forbids (structured outputs) get -inf;
3. the logits processors that can change the argmax (``sparrow.sample.logits_processor``): the
   built-ins allowed_token_ids, bad_words, min_tokens (EOS and stop ids of rows short of it get
   -inf) and logit_bias, then those a plugin enabled;
4. penalties: repetition (prompt and output tokens), frequency and presence (output tokens only);
5. greedy rows take the argmax of the penalised logits;
6. random rows: temperature, the argmax-invariant logits processors, min-p, top-k, top-p, then a
   draw from the resulting probs by inverting each row's cumulative distribution at one uniform
   number per row: from the shared generator for unseeded rows, derived from (seed, position)
   alone for seeded rows, so that a seeded row's token depends on nothing else in the batch.

Everything but the processors is batched torch and device-agnostic, with no per-row loop or
kernel launch; the built-in processors rebuild their index tensors only when the batch changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sparrow.sample.logprobs import LogprobsTensors, gather_logprobs
from sparrow.sample.metadata import SamplingMetadata, pad_token_ids, sum_dtype
from sparrow.wire import TokenLogprobs

_SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Rows in batch order, k = the batch's max_num_logprobs; None when no row asked for logprobs.
    logprobs: LogprobsTensors | None
    # Per row, the k it asked for (None = no logprobs); cuts ``logprobs`` back per row.
    num_logprobs: list[int | None]

    def logprobs_lists(self) -> list[TokenLogprobs | None] | None:
        """Per row: its ``TokenLogprobs`` (chosen token first), or None if it did not ask."""
        if self.logprobs is None:
            return None
        return self.logprobs.to_lists(self.num_logprobs)


class Sampler:
    """Stateless apart from the generator that unseeded random rows draw from.

    ``generator``: the shared source of noise for unseeded rows (torch's default generator of the
    logits' device when None). Seeded rows never touch it.
    ``platform``: the platform whose implementations of the function ops ``top_k_top_p`` and
    ``draw`` serve this sampler (resolved once, here); None: the torch references below.
    ``top_k_top_p_op`` / ``draw_op``: functions to use instead (the references' signatures).
    """

    def __init__(self, generator: torch.Generator | None = None, platform: str | None = None, *,
                 top_k_top_p_op: Callable[..., torch.Tensor] | None = None,
                 draw_op: Callable[..., torch.Tensor] | None = None) -> None:
        self.generator = generator
        if platform is not None:
            from sparrow.ops.binding import resolve_function_op

            top_k_top_p_op = top_k_top_p_op or resolve_function_op("top_k_top_p", platform)
            draw_op = draw_op or resolve_function_op("draw", platform)
        self.top_k_top_p = top_k_top_p_op or apply_top_k_top_p
        self.draw = draw_op or draw

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.temperature.shape[0]:
            raise ValueError(
                f"logits must be [batch, vocab] with batch = "
                f"{metadata.temperature.shape[0]}, got {tuple(logits.shape)}"
            )
        if logits.shape[1] != metadata.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, metadata was built for vocab_size "
                f"{metadata.vocab_size}"
            )
        caller_logits = logits
        logits = logits.to(torch.float32)
        raw_logprobs = (
            logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None
        )  # [B, V]

        # Every step below returns a new tensor or works on one the sampler owns: the caller's
        # logits (and the raw logprobs) stay untouched.
        if metadata.grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, *metadata.grammar_bitmask)
        if metadata.logits_processors is not None:
            logits = metadata.logits_processors.apply_non_argmax_invariant(logits, owned=logits is not caller_logits)
        logits = apply_penalties(logits, metadata)
        sampled = self._sample(logits, metadata)

        logprobs = None
        if raw_logprobs is not None and metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(
            sampled_token_ids=sampled, logprobs=logprobs, num_logprobs=metadata.num_logprobs
        )

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        greedy_ids = None if metadata.all_random else logits.argmax(dim=-1)  # [B]

        greedy_rows = metadata.temperature < _SAMPLING_EPS  # [B]
        # Greedy rows divide by 1 so their (discarded) random branch stays finite.
        temperature = torch.where(greedy_rows, 1.0, metadata.temperature)
        logits = logits / temperature.unsqueeze(1)
        if metadata.logits_processors is not None and metadata.logits_processors.argmax_invariant:
            logits = metadata.logits_processors.apply_argmax_invariant(logits, owned=True)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = self.top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)  # [B, V]
        random_ids = self.draw(probs, self.generator, metadata.seeded_rows, metadata.seeded_uniforms)
        if greedy_ids is None:
            return random_ids
        return torch.where(greedy_rows, greedy_ids, random_ids)


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
    num_rows, vocab_size = logits.shape
    # Column vocab_size collects the padding and is dropped.
    output_ids = pad_token_ids(metadata.output_token_ids, vocab_size, logits.device)  # [B, L]
    output_counts = torch.zeros(num_rows, vocab_size + 1, device=logits.device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
    output_counts = output_counts[:, :vocab_size]  # [B, V]
    in_output = output_counts > 0  # [B, V]

    if repetition is not None:
        seen = in_output.clone()
        if metadata.prompt_token_ids is not None:
            prompt_seen = torch.zeros(
                num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device
            )
            prompt_seen.scatter_(1, metadata.prompt_token_ids, True)
            seen |= prompt_seen[:, :vocab_size]
        penalty = repetition.unsqueeze(1)  # [B, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * output_counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability.

    ``min_p``: [B] with 0 for rows that do not use it (nothing is below 0).
    """
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose mass reaches p, per row.

    ``top_k``: [B] int, 0 = off; ``top_p``: [B] float, 1 = off. One ascending sort serves both.
    Ties are kept together: a row's cut is turned into a logit threshold, so every token equal to
    the last survivor survives too, whatever order the sort left the ties in. That may keep a few
    more than k tokens, never fewer, and never drops part of a tie.
    """
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


def draw(
    probs: torch.Tensor,
    generator: torch.Generator | None,
    seeded_rows: torch.Tensor | None,
    seeded_uniforms: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row of ``probs`` [B, V], each by :func:`inverse_cdf` at its own uniform:
    seeded rows at the uniform their (seed, position) gives, the others at one drawn from
    ``generator``."""
    uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=sum_dtype(probs.device))
    if seeded_rows is not None and seeded_rows.shape[0] > 0:
        uniforms.index_copy_(0, seeded_rows, seeded_uniforms.to(uniforms.dtype))
    return inverse_cdf(probs, uniforms)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample row r of ``probs`` [S, V] at ``uniforms[r]`` in [0, 1): the first token whose
    cumulative probability exceeds ``u * total``. A pure function of the row and its uniform, and
    a zero-probability token is never chosen. Sums are float64 (see ``sum_dtype``), so that even a
    token of probability 1e-9 keeps its share after 150k additions (float32 would round it away).

    Two levels, so the work over the whole vocabulary is one reading pass: the vocabulary is cut
    into chunks, the chunk sums locate the chunk holding the target, and only that chunk is
    scanned token by token.
    """
    num_rows, vocab = probs.shape
    dtype = sum_dtype(probs.device)
    chunk = _chunk_size(vocab)
    if chunk == 0:
        return _search(probs.to(dtype).cumsum(dim=-1), uniforms.to(dtype).unsqueeze(1))
    chunked = probs.view(num_rows, vocab // chunk, chunk)
    chunk_cdf = chunked.sum(dim=-1, dtype=dtype).cumsum(dim=-1)  # [S, N]
    target = uniforms.to(dtype).unsqueeze(1) * chunk_cdf[:, -1:]  # [S, 1]
    index = _search(chunk_cdf, target).unsqueeze(1)  # [S, 1] chunk holding the target
    before = torch.where(index > 0, chunk_cdf.gather(1, (index - 1).clamp(min=0)), 0.0)  # mass before it
    inner = chunked.gather(1, index.unsqueeze(2).expand(num_rows, 1, chunk)).squeeze(1)  # [S, chunk]
    offset = _search(before + inner.to(dtype).cumsum(dim=-1), target)
    return index.squeeze(1) * chunk + offset


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first column of each row of ``cdf`` (non-decreasing) above ``target`` [S, 1]; when
    rounding put the target at or past the row's end, the row's last column with mass."""
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    last = (cdf < cdf[:, -1:]).sum(dim=-1)  # the first column reaching the end: the last with mass
    return torch.minimum(ids, last)


def _chunk_size(vocab: int) -> int:
    """The largest power of two up to 1024 that divides ``vocab``, or 0 when that is under 32
    (the scan then runs over the whole row)."""
    size = 1024
    while size >= 32:
        if vocab % size == 0:
            return size
        size //= 2
    return 0
