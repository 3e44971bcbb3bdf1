"""The worker's half of speculative decoding: put the scheduled drafts in the persistent batch,
verify them after the forward pass, and propose the next ones.

Called by :class:`sparrow.worker.model_runner.ModelRunner` only when speculation is configured
(proposing) or a step carries drafts (verifying); a step without drafts runs the plain path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sparrow.sample.filters import apply_grammar_bitmask
from sparrow.spec_decode.proposer import may_speculate
from sparrow.spec_decode.rejection_sampler import accept_point_drafts, sample_positions, seeded_draws

if TYPE_CHECKING:
    from sparrow.worker.input_batch import InputBatch
    from sparrow.worker.model_runner import ModelRunner, StepInputs
    from sparrow.worker.outputs import TokenLogprobs

_SAMPLING_EPS = 1e-5


def write_draft_tokens(batch: InputBatch, spec_decode_tokens: dict[str, list[int]]) -> None:
    """Place each request's drafts right after its tokens, where ``prepare_inputs`` reads the
    step's input ids; ``num_tokens`` does not count them (accepted ones are appended later)."""
    for req_id, drafts in spec_decode_tokens.items():
        row = batch.req_id_to_row.get(req_id)
        if row is None or not drafts:
            continue
        start = int(batch.num_tokens[row])
        batch.token_ids[row, start : start + len(drafts)] = drafts


def verify_drafts(runner: ModelRunner, hidden_states: torch.Tensor,
                  inputs: StepInputs) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
    """Sample the step's tokens when some requests carry drafts: per row, the accepted drafts and
    one more token (``sparrow.spec_decode.rejection_sampler``); rows without drafts get exactly
    what the plain path gives them. Updates the persistent batch like the plain path does.

    A request with a grammar has one mask per verified position (``inputs.grammar_bitmask`` for
    position 0, through the sampler; ``inputs.draft_grammar_bitmask`` for the drafts' positions),
    so every token it can end up with is one its grammar allows there."""
    batch = runner.batch
    num_reqs = batch.num_reqs
    spec = inputs.spec_decode_tokens
    drafts = [list(spec.get(req_id, ())) for req_id in batch.req_ids]
    num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=num_reqs)
    query_start_loc = inputs.metadata.query_start_loc_cpu.numpy().astype(np.int64)
    last = query_start_loc[1:] - 1  # [num_reqs] flat index of each row's last input token
    first = last - num_drafts  # its verification start: the request's last real token
    counts = num_drafts + 1
    # Flat indices of every verified position, row by row: first[r] .. last[r].
    starts = np.cumsum(counts) - counts  # [num_reqs] where each row's positions begin in the list
    flat = np.repeat(first, counts) + (np.arange(int(counts.sum())) - np.repeat(starts, counts))
    logits = runner.model.compute_logits(hidden_states[runner.to_device(flat)])  # [P, V]
    starts_t = runner.to_device(starts)
    metadata = runner.sampling_metadata(inputs)

    # Position 0 of every row: the full sampler, as without speculation.
    sampler_output = runner.sampler(logits.index_select(0, starts_t), metadata)
    first_tokens = runner.agree_on_sampled(sampler_output.sampled_token_ids).tolist()
    logprobs_rows = sampler_output.logprobs_lists()

    later_tokens: list[int] = []
    if int(num_drafts.sum()):
        is_later = np.ones(flat.shape[0], dtype=bool)
        is_later[starts] = False
        rows = np.repeat(np.arange(num_reqs), num_drafts)  # [D] batch row of each later position
        offsets = np.arange(rows.shape[0]) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts) + 1
        seeds, positions = [], []
        for row, offset in zip(rows.tolist(), offsets.tolist()):
            params = batch.states[row].sampling_params
            seeded = params.seed is not None and params.temperature >= _SAMPLING_EPS
            seeds.append(params.seed if seeded else None)
            positions.append(len(batch.states[row].output_token_ids) + offset)
        seeded_positions, seeded_uniforms = seeded_draws(seeds, positions, logits.device)
        later_logits = logits[runner.to_device(np.flatnonzero(is_later))]  # [D, V]
        if inputs.draft_grammar_bitmask is not None:
            # Each constrained draft position under its grammar's mask after the drafts before it.
            later_logits = apply_grammar_bitmask(later_logits, *inputs.draft_grammar_bitmask)
        later = sample_positions(later_logits, runner.to_device(rows), metadata, runner.sampler,
                                 seeded_positions, seeded_uniforms)
        later_tokens = runner.agree_on_sampled(later).tolist()
    accepted = accept_point_drafts(first_tokens, drafts, later_tokens)

    sampled_token_ids: list[list[int]] = []
    logprobs: dict[str, list[TokenLogprobs]] = {}
    for row in range(num_reqs):
        if not inputs.complete_rows[row]:
            sampled_token_ids.append([])
            continue
        tokens = accepted[row]
        state = batch.states[row]
        state.output_token_ids.extend(tokens)
        for token_id in tokens:
            batch.append_token(row, token_id)
        # The rejected drafts' KV is not the request's: it is overwritten by the next steps.
        batch.num_computed_tokens[row] -= int(num_drafts[row]) - (len(tokens) - 1)
        sampled_token_ids.append(tokens)
        if logprobs_rows is not None and logprobs_rows[row] is not None:
            logprobs[state.req_id] = [logprobs_rows[row]]
    return sampled_token_ids, logprobs


def propose_drafts(runner: ModelRunner, sampled_token_ids: list[list[int]],
                   hidden_states: Any, inputs: StepInputs | None = None) -> list[list[int]]:
    """The next step's drafts, one list per row (empty for rows that sampled nothing, still
    prefill, or may not speculate: see ``may_speculate``)."""
    batch = runner.batch
    runner.proposer.step_metadata = inputs.metadata if inputs is not None else None
    rows = [row for row, tokens in enumerate(sampled_token_ids)
            if tokens and may_speculate(batch.states[row].sampling_params, runner.plugin_logits_processors)]
    out: list[list[int]] = [[] for _ in range(batch.num_reqs)]
    if not rows:
        return out
    for row, drafts in zip(rows, runner.proposer.propose(rows, batch.token_ids, batch.num_tokens, hidden_states)):
        out[row] = [int(token_id) for token_id in drafts[: runner.proposer.num_speculative_tokens]]
    return out
