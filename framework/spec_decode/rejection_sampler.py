"""Verification: which drafts the target model accepts, and the token it adds after them.

For a request with drafts ``d_1..d_k`` the step feeds ``[t, d_1, ..., d_k]`` (t: its last token)
and gets the target's logits at every one of those k + 1 positions: position j predicts the token
after ``d_j`` (position 0 the token after t).

**Point-mass drafts** (n-gram: the proposer puts all its mass on one token): at each position
the target *samples* its own token ``x_j`` exactly as the engine without speculation would (the
same temperature, top-k, top-p, min-p, and for a seeded request the same uniform, from the
request's seed and the token's position); the draft is accepted while ``x_j == d_{j+1}``, and the
first ``x_j`` that differs (or ``x_k`` when all are accepted: the bonus token) ends the step.
That *is* speculative rejection sampling for a point-mass draft: the draft is accepted with
probability ``p(d)``, and on rejection the token is ``x ~ p`` conditioned on ``x != d``, which is
``p`` with ``d`` removed and renormalised. So the output distribution is the target's, greedy
output (temperature 0: x_j is the argmax) is identical token for token, and a seeded request
produces the same tokens with or without speculation.

**Drafts with a distribution q** (a draft model or head, later): :func:`rejection_sample` is
the general rule: accept ``d`` with probability ``min(1, p(d) / q(d))``, on rejection sample from
``max(p - q, 0)`` renormalised.
"""

from __future__ import annotations

import torch

from sparrow.sample.filters import apply_min_p, apply_top_k_top_p
from sparrow.sample.metadata import SamplingMetadata, step_uniform, sum_dtype
from sparrow.sample.sampler import Sampler, inverse_cdf

_SAMPLING_EPS = 1e-5


def sample_positions(logits: torch.Tensor, rows: torch.Tensor, metadata: SamplingMetadata, sampler: Sampler,
                     seeded_positions: torch.Tensor | None = None,
                     seeded_uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per position of ``logits`` [P, V], position p sampled with the settings of batch
    row ``rows[p]`` (temperature, min-p, top-k, top-p: requests that need more do not speculate).

    Seeded positions draw at ``seeded_uniforms`` (their (seed, position) uniforms), the others
    at uniforms from the sampler's generator."""
    logits = logits.to(torch.float32)
    if metadata.all_greedy:
        return logits.argmax(dim=-1)
    temperature = metadata.temperature.index_select(0, rows)  # [P]
    greedy = temperature < _SAMPLING_EPS
    logits_for_draw = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if metadata.min_p is not None:
        logits_for_draw = apply_min_p(logits_for_draw, metadata.min_p.index_select(0, rows))
    top_k = metadata.top_k.index_select(0, rows) if metadata.top_k is not None else None
    top_p = metadata.top_p.index_select(0, rows) if metadata.top_p is not None else None
    if top_k is not None or top_p is not None:
        if sampler.top_k_top_p is apply_top_k_top_p:  # the batch's k bound holds for its positions too
            logits_for_draw = apply_top_k_top_p(logits_for_draw, top_k, top_p, max_top_k=metadata.max_top_k)
        else:
            logits_for_draw = sampler.top_k_top_p(logits_for_draw, top_k, top_p)
    drawn = sampler.draw(logits_for_draw.softmax(dim=-1), sampler.generator, seeded_positions, seeded_uniforms)
    if metadata.all_random:
        return drawn
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def seeded_draws(seeds: list[int | None], positions: list[int],
                 device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(indices, uniforms)`` of the seeded entries of ``seeds`` (one per sampled position; None:
    unseeded), each uniform from (seed, output position) as the sampler's seeded rows use."""
    indices = [index for index, seed in enumerate(seeds) if seed is not None]
    if not indices:
        return None, None
    uniforms = [step_uniform(seeds[index], positions[index]) for index in indices]
    return (torch.tensor(indices, dtype=torch.int64, device=device),
            torch.tensor(uniforms, dtype=sum_dtype(device), device=device))


def accept_point_drafts(first_tokens: list[int], draft_tokens: list[list[int]],
                        later_tokens: list[int]) -> list[list[int]]:
    """Per request: the accepted drafts and the token that follows them.

    ``first_tokens[r]``: the target's token at request r's position 0; ``later_tokens``: its
    tokens at positions 1..k of every request with drafts, flattened in request order.
    """
    out: list[list[int]] = []
    offset = 0
    for first, drafts in zip(first_tokens, draft_tokens):
        tokens = [first]
        for j, draft in enumerate(drafts):
            if tokens[-1] != draft:
                break
            tokens.append(later_tokens[offset + j])
        offset += len(drafts)
        out.append(tokens)
    return out


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor,
                     num_drafts: list[int], bonus_token_ids: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[list[int]]:
    """Speculative rejection sampling for drafts drawn from a distribution (draft model, EAGLE).

    ``target_probs`` / ``draft_probs``: [D, V], the target's and the proposer's distributions at
    every draft position (requests in order, ``num_drafts[r]`` positions each);
    ``draft_token_ids`` [D]; ``bonus_token_ids`` [R]: each request's target token after its last
    draft (used when every draft is accepted). Returns per request the accepted drafts plus one
    token: the recovered token at the first rejection, or the bonus token.
    """
    dtype = sum_dtype(target_probs.device)
    positions = torch.arange(draft_token_ids.shape[0], device=target_probs.device)
    p = target_probs[positions, draft_token_ids].to(dtype)
    q = draft_probs[positions, draft_token_ids].to(dtype)
    uniforms = torch.rand(p.shape[0], generator=generator, device=p.device, dtype=dtype)
    # Accept when u * q <= p: probability min(1, p / q), and q = 0 (never drafted) always accepts.
    accepted = (uniforms * q <= p).tolist()
    residual = (target_probs.to(dtype) - draft_probs.to(dtype)).clamp(min=0)  # [D, V]
    # Where the residual is all zero (p == q) rejection has probability 0; keep p to stay finite.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs.to(dtype), residual)
    residual = residual / residual.sum(dim=-1, keepdim=True)  # inverse_cdf expects rows summing to 1
    recovered = inverse_cdf(residual, torch.rand(p.shape[0], generator=generator, device=p.device,
                                                 dtype=dtype)).tolist()
    drafts, bonus = draft_token_ids.tolist(), bonus_token_ids.tolist()
    out: list[list[int]] = []
    offset = 0
    for request, count in enumerate(num_drafts):
        tokens: list[int] = []
        for j in range(offset, offset + count):
            if not accepted[j]:
                tokens.append(recovered[j])
                break
            tokens.append(drafts[j])
        else:
            tokens.append(bonus[request])
        offset += count
        out.append(tokens)
    return out
