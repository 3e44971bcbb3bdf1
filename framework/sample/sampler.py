"""The sampler: logits [B, V] + SamplingMetadata -> one token per row (and its logprobs).

The order follows vLLM V1:

1. logprobs for the output come from the raw logits (the model's own distribution), for the
   rows that asked only, and not at all when none did (taken last, from the untouched logits);
   vLLM's ``logprobs_mode`` picks what is reported: ``raw_logprobs`` (that, the default),
   ``raw_logits`` (the logits themselves), ``processed_logprobs`` / ``processed_logits`` (what the
   token was drawn from: after steps 2-4 for a greedy row, after step 6's temperature and filters
   for a random one, tokens filtered out at -inf);
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
   When only the temperature applies, a platform's ``sample_from_logits`` op (CUDA: one fused
   Triton pass) samples those rows straight from the logits at the same uniforms.

Everything but the processors is batched torch and device-agnostic, with no per-row loop or
kernel launch; the built-in processors rebuild their index tensors only when the batch changes.
No float64 pass over the whole vocabulary: the draw sums the vocabulary in float32 chunks and
uses float64 only over chunk totals and inside one chunk per row (see ``inverse_cdf``). The
filters of steps 2 and 6 (grammar bitmask, min-p, top-k/top-p) are ``sparrow.sample.filters``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from sparrow.sample.filters import apply_grammar_bitmask, apply_min_p, apply_top_k_top_p
from sparrow.sample.logprobs import LogprobsTensors, gather_logprobs
from sparrow.sample.metadata import SamplingMetadata, sum_dtype
from sparrow.sample.penalties import apply_penalties
from sparrow.wire import TokenLogprobs

__all__ = ["Sampler", "SamplerOutput", "apply_grammar_bitmask", "apply_min_p", "apply_top_k_top_p", "draw",
           "draw_uniforms", "inverse_cdf", "sample_from_logits"]

_SAMPLING_EPS = 1e-5
# vLLM's logprobs_mode values.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Rows in batch order, k = the batch's max_num_logprobs; None when no row asked for logprobs.
    logprobs: LogprobsTensors | None
    # Per row, the k it asked for (None = no logprobs); cuts ``logprobs`` back per row.
    num_logprobs: list[int | None]
    # logprob_token_ids: row -> (token ids, logprobs, ranks) of the ids that row asked for.
    extra_logprobs: dict[int, tuple[list[int], list[float], list[int]]] | None = None

    def logprobs_lists(self) -> list[TokenLogprobs | None] | None:
        """Per row: its ``TokenLogprobs`` (chosen token first, then its top k, then the
        ``logprob_token_ids`` not among them), or None if it did not ask."""
        if self.logprobs is None:
            return None
        lists = self.logprobs.to_lists(self.num_logprobs)
        for row, (token_ids, logprobs, ranks) in (self.extra_logprobs or {}).items():
            entry = lists[row]
            if entry is None:
                continue
            for token_id, logprob, rank in zip(token_ids, logprobs, ranks):
                if token_id not in entry.token_ids:
                    entry.token_ids.append(token_id)
                    entry.logprobs.append(logprob)
                    entry.ranks.append(rank)
        return lists


class Sampler:
    """Stateless apart from the generator that unseeded random rows draw from.

    ``generator``: the shared source of noise for unseeded rows (torch's default generator of the
    logits' device when None). Seeded rows never touch it.
    ``platform``: the platform whose implementations of the function ops ``top_k_top_p``,
    ``draw`` and ``sample_from_logits`` serve this sampler (resolved once, here); None: the torch
    references below.
    ``top_k_top_p_op`` / ``draw_op`` / ``sample_from_logits_op``: functions to use instead (the
    references' signatures).

    ``sample_from_logits`` serves the random rows when nothing but the temperature acts after the
    penalties (no min-p, top-k, top-p or argmax-invariant logits processor), at the uniforms
    ``draw`` would use; only a platform's own implementation (or one given here) does: without
    one, those rows take the steps one by one (temperature, softmax, ``draw``), which is what the
    reference does anyway, so a platform that serves ``draw`` alone keeps its ``draw``.
    """

    def __init__(self, generator: torch.Generator | None = None, platform: str | None = None, *,
                 top_k_top_p_op: Callable[..., torch.Tensor] | None = None,
                 draw_op: Callable[..., torch.Tensor] | None = None,
                 sample_from_logits_op: Callable[..., torch.Tensor] | None = None,
                 logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.generator = generator
        if platform is not None:
            from sparrow.ops.binding import resolve_function_op

            top_k_top_p_op = top_k_top_p_op or resolve_function_op("top_k_top_p", platform)
            draw_op = draw_op or resolve_function_op("draw", platform)
            if sample_from_logits_op is None:
                resolved = resolve_function_op("sample_from_logits", platform)
                sample_from_logits_op = None if resolved is sample_from_logits else resolved
        self.top_k_top_p = top_k_top_p_op or apply_top_k_top_p
        self.draw = draw_op or draw
        # None: the random rows go through temperature, softmax and ``draw`` step by step.
        self.sample_from_logits = sample_from_logits_op

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
        logits = raw_logits = logits.to(torch.float32)

        # Every step below returns a new tensor or works on one the sampler owns: the caller's
        # logits (``raw_logits``, which the logprobs are taken from at the end) stay untouched.
        if metadata.grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, *metadata.grammar_bitmask)
        if metadata.logits_processors is not None:
            # The float32 copy of non-float32 logits is the sampler's, unless the logprobs still need it.
            owned = logits is not caller_logits and not (logits is raw_logits and metadata.max_num_logprobs is not None)
            logits = metadata.logits_processors.apply_non_argmax_invariant(logits, owned=owned)
        logits = apply_penalties(logits, metadata)
        processed = metadata.max_num_logprobs is not None and self.logprobs_mode.startswith("processed")
        sampled, processed_logits = self._sample(logits, metadata, keep_processed=processed)

        logprobs = None
        if metadata.max_num_logprobs is not None:
            source = raw_logits
            if processed:
                assert processed_logits is not None  # _sample keeps them when asked
                source = processed_logits
            logprobs, extra = _logprobs(source, sampled, metadata.max_num_logprobs, metadata.logprob_rows,
                                        normalize=self.logprobs_mode.endswith("logprobs"),
                                        num_logprobs=metadata.num_logprobs, requested=metadata.logprob_token_ids)
            return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, num_logprobs=metadata.num_logprobs,
                                 extra_logprobs=extra)
        return SamplerOutput(
            sampled_token_ids=sampled, logprobs=logprobs, num_logprobs=metadata.num_logprobs
        )

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata, keep_processed: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled ids [B], and (``keep_processed``) the logits each row's token was drawn from."""
        if metadata.all_greedy:
            return logits.argmax(dim=-1), (logits if keep_processed else None)
        greedy_ids = None if metadata.all_random else logits.argmax(dim=-1)  # [B]

        greedy_rows = metadata.temperature < _SAMPLING_EPS  # [B]
        # Greedy rows divide by 1 so their (discarded) random branch stays finite.
        temperature = torch.where(greedy_rows, 1.0, metadata.temperature)
        if self.sample_from_logits is not None and _temperature_only(metadata):
            uniforms = draw_uniforms(logits.shape[0], logits.device, self.generator, metadata.seeded_rows,
                                     metadata.seeded_uniforms)
            random_ids = self.sample_from_logits(logits, temperature, uniforms)
            random_logits = logits / temperature.unsqueeze(1) if keep_processed else None
        else:
            random_ids, random_logits = self._filter_and_draw(logits, temperature, metadata)
        ids = random_ids if greedy_ids is None else torch.where(greedy_rows, greedy_ids, random_ids)
        if not keep_processed or random_logits is None:
            return ids, None
        # A greedy row's token came from its plain (penalised) logits.
        processed = random_logits if greedy_ids is None else torch.where(greedy_rows.unsqueeze(1), logits,
                                                                         random_logits)
        return ids, processed

    def _filter_and_draw(self, logits: torch.Tensor, temperature: torch.Tensor,
                         metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, the argmax-invariant processors, min-p, top-k/top-p, then one draw per
        row: the ids, and the filtered logits they were drawn from."""
        logits = logits / temperature.unsqueeze(1)
        if metadata.logits_processors is not None and metadata.logits_processors.argmax_invariant:
            logits = metadata.logits_processors.apply_argmax_invariant(logits, owned=True)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            if self.top_k_top_p is apply_top_k_top_p:  # the reference can use the batch's k bound
                logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, max_top_k=metadata.max_top_k)
            else:
                logits = self.top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)  # [B, V]
        return self.draw(probs, self.generator, metadata.seeded_rows, metadata.seeded_uniforms), logits


def _temperature_only(metadata: SamplingMetadata) -> bool:
    """Whether nothing but the temperature changes the random rows' logits after the penalties."""
    processors = metadata.logits_processors
    return (metadata.min_p is None and metadata.top_k is None and metadata.top_p is None
            and not (processors is not None and processors.argmax_invariant))


def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int, rows: torch.Tensor | None,
              normalize: bool = True, num_logprobs: list[int | None] | None = None,
              requested: list[list[int] | None] | None = None
              ) -> tuple[LogprobsTensors, dict[int, tuple[list[int], list[float], list[int]]] | None]:
    """The reported logprobs, [B, 1 + k] in batch order, from ``logits`` (log-softmaxed when
    ``normalize``, as they are otherwise: the ``*_logits`` modes); with ``rows`` (some rows
    asked), computed for those rows alone and placed at them (zeros elsewhere, never read).
    ``requested``: per row, its logprob_token_ids (rows that set them asked for logprobs too);
    their values and ranks, from the same values, come back as ``{row: (ids, values, ranks)}``."""
    selected = logits if rows is None else logits.index_select(0, rows)
    values = selected.log_softmax(dim=-1) if normalize else selected
    tensors = gather_logprobs(values, sampled if rows is None else sampled.index_select(0, rows), k)
    if rows is not None:
        tensors = tensors.placed_at(rows, logits.shape[0])
    if requested is None:
        return tensors, None
    # batch row -> its row in ``values``: the rows that asked for logprobs, in batch order.
    asking: Sequence[int]
    if rows is None:
        asking = range(len(requested))
    else:
        asking = [row for row, n in enumerate(num_logprobs or []) if n is not None]
    position = {row: index for index, row in enumerate(asking)}
    asked = [(row, ids) for row, ids in enumerate(requested) if ids]
    # One gather and one comparison for every asking row: ids padded to the longest list.
    width = max(len(ids) for _, ids in asked)
    padded = torch.tensor([list(ids) + [ids[0]] * (width - len(ids)) for _, ids in asked], dtype=torch.int64)
    source_rows = torch.tensor([position[row] for row, _ in asked], dtype=torch.int64, device=logits.device)
    row_values = values.index_select(0, source_rows)  # [R, V]
    picked = row_values.gather(1, padded.to(logits.device))  # [R, width]
    ranks = (row_values.unsqueeze(1) > picked.unsqueeze(2)).sum(dim=2) + 1  # [R, width]
    chosen_lists, rank_lists = picked.float().cpu().tolist(), ranks.cpu().tolist()
    extra = {row: (list(ids), chosen_lists[i][:len(ids)], rank_lists[i][:len(ids)])
             for i, (row, ids) in enumerate(asked)}
    return tensors, extra


def draw(
    probs: torch.Tensor,
    generator: torch.Generator | None,
    seeded_rows: torch.Tensor | None,
    seeded_uniforms: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row of ``probs`` [B, V], each by :func:`inverse_cdf` at its own uniform
    (:func:`draw_uniforms`)."""
    return inverse_cdf(probs, draw_uniforms(probs.shape[0], probs.device, generator, seeded_rows, seeded_uniforms))


def draw_uniforms(
    num_rows: int,
    device: torch.device,
    generator: torch.Generator | None,
    seeded_rows: torch.Tensor | None,
    seeded_uniforms: torch.Tensor | None,
) -> torch.Tensor:
    """One uniform in [0, 1) per row, [B] in ``sum_dtype(device)``: seeded rows get the uniform
    their (seed, position) gives, the others one drawn from ``generator`` (one ``torch.rand`` of
    B numbers, whatever the number of seeded rows)."""
    uniforms = torch.rand(num_rows, generator=generator, device=device, dtype=sum_dtype(device))
    if seeded_rows is not None and seeded_rows.shape[0] > 0:
        assert seeded_uniforms is not None, "seeded rows come with their uniforms"
        uniforms.index_copy_(0, seeded_rows, seeded_uniforms.to(uniforms.dtype))
    return uniforms


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (any float dtype) at temperature ``temperature``
    [B] (> 0) and uniform ``uniforms`` [B] in [0, 1): :func:`inverse_cdf` of ``softmax(logits /
    T)`` in float32, what the sampler does step by step for rows nothing else filters. A platform
    may serve it with one fused pass (the ``sample_from_logits`` op)."""
    probs = (logits.to(torch.float32) / temperature.unsqueeze(1)).softmax(dim=-1)
    return inverse_cdf(probs, uniforms)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample row r of ``probs`` [S, V] at ``uniforms[r]`` in [0, 1): the first token whose
    cumulative probability exceeds ``u * total``. A pure function of the row and its uniform, and
    a zero-probability token is never chosen.

    Two levels, so the only work over the whole vocabulary is one read in the probabilities' own
    dtype: the vocabulary is cut into chunks of C <= 128 tokens and summed chunk by chunk (float32
    for float32 probs); the cumulative of the V / C chunk sums (in ``sum_dtype``, float64 on CPU
    and CUDA) locates the chunk holding the target; only that chunk is scanned token by token
    (C values per row, in ``sum_dtype``), at the target's fraction of the chunk's sum.

    Error bound: a float32 sum of C non-negative terms is within a factor 1 +- e of the exact
    sum, e = (C - 1) * 2**-24 (about 7.6e-6 at C = 128), whatever the summation order; everything
    after it is float64 (relative error ~1e-16 * V / C). Each chunk's share of the row is thus off
    by a factor within 1 +- 2e, and a token's share of its chunk is exact to float64: every token,
    however small (1e-9 included), is drawn with its probability times a factor within 1 +- 2e,
    about 1.5e-5. The token is the one a float64 inverse CDF over the whole row picks unless
    ``u`` lies within that relative distance of a token boundary. A zero-probability token never
    comes out: the chunk chosen is one whose sum is positive (the cumulative strictly rises
    there), and inside it the first token whose cumulative exceeds the target has mass of its own.
    """
    num_rows, vocab = probs.shape
    dtype = sum_dtype(probs.device)
    chunk = _chunk_size(vocab)
    if chunk == 0:
        return _search(probs.to(dtype).cumsum(dim=-1), uniforms.to(dtype).unsqueeze(1))
    if vocab % chunk:  # zeros past the end: they can never be chosen
        probs = torch.nn.functional.pad(probs, (0, chunk - vocab % chunk))
    chunked = probs.reshape(num_rows, -1, chunk)  # [S, N, C]
    chunk_cdf = chunked.sum(dim=-1).to(dtype).cumsum(dim=-1)  # [S, N]
    target = uniforms.to(dtype).unsqueeze(1) * chunk_cdf[:, -1:]  # [S, 1]
    index = _search(chunk_cdf, target).unsqueeze(1)  # [S, 1] the chunk holding the target
    before = torch.where(index > 0, chunk_cdf.gather(1, (index - 1).clamp(min=0)), 0.0)  # mass before it
    size = chunk_cdf.gather(1, index) - before  # [S, 1] its sum, > 0 (the cumulative rises there)
    inner = chunked.gather(1, index.unsqueeze(2).expand(num_rows, 1, chunk)).squeeze(1).to(dtype)
    inner_cdf = inner.cumsum(dim=-1)  # [S, C]
    # The target's place in the chunk as a fraction of its (float32-summed) size, applied to the
    # chunk's exact cumulative: tokens split their chunk's share in exact proportion. A fraction
    # rounded up to 1 lands past the end, where _search takes the chunk's last token with mass.
    fraction = (target - before) / size
    offset = _search(inner_cdf, fraction * inner_cdf[:, -1:])
    return index.squeeze(1) * chunk + offset


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first column of each row of ``cdf`` (non-decreasing) above ``target`` [S, 1]; when
    rounding put the target at or past the row's end, the row's last column with mass."""
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    last = (cdf < cdf[:, -1:]).sum(dim=-1)  # the first column reaching the end: the last with mass
    return torch.minimum(ids, last)


# Vocabularies up to this size are scanned whole (a single cumsum, cheap at any precision).
_WHOLE_ROW_MAX = 2048


def _chunk_size(vocab: int) -> int:
    """0 (scan the whole row) for a small vocabulary; else 128, or 64 or 32 when that divides
    ``vocab`` and 128 does not (no padding copy); 128 with padding otherwise. Small chunks keep
    the float32 chunk sums' error bound small (see ``inverse_cdf``)."""
    if vocab <= _WHOLE_ROW_MAX:
        return 0
    for size in (128, 64, 32):
        if vocab % size == 0:
            return size
    return 128
