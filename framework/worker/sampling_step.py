"""The sampling half of a model runner step: the engine core's grammar masks placed for the batch,
the sampling metadata, one token per row (or the verification of drafts), rank agreement under
tensor parallelism, prompt logprobs and the next drafts.

:class:`SamplingStep` is a mixin of :class:`sparrow.worker.model_runner.ModelRunner`, which holds
the state it reads (``batch``, ``model``, ``sampler``, ``sampling_tensors``, ``proposer``,
``to_device``); split from it by idea, the forward half stays there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from sparrow.core.sched.output import SchedulerOutput
from sparrow.sample.logprobs import compute_token_logprobs
from sparrow.sample.metadata import SamplingMetadata
from sparrow.spec_decode.worker import propose_drafts, verify_drafts
from sparrow.worker.deferred_tokens import DeferredStepOutput, PendingTokens, sampled_lists
from sparrow.worker.outputs import ModelRunnerOutput, TokenLogprobs

if TYPE_CHECKING:
    from sparrow.worker.model_runner import ModelRunner, StepInputs


class SamplingStep:
    """Sampling and outputs of a step (a mixin: see the module docstring)."""

    batch: Any
    model: Any
    sampler: Any
    sampling_tensors: Any
    proposer: Any
    token_copies: Any
    _pending: PendingTokens | None
    _sampling_version: int

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    @property
    def runner(self) -> ModelRunner:
        """This object as the model runner it is a mixin of."""
        return cast("ModelRunner", self)

    def grammar_bitmask(self, so: SchedulerOutput) -> tuple[tuple[torch.Tensor, torch.Tensor] | None,
                                                            tuple[torch.Tensor, torch.Tensor] | None]:
        """The engine core's bitmask rows placed for this batch: ``(first, drafts)``. ``first``:
        each constrained request's mask for the token after its tokens, at its batch row;
        ``drafts``: the masks of the draft positions it verifies, at their index among the step's
        draft positions (row by row in batch order, as ``verify_drafts`` lays them out), or None
        when no constrained request carries drafts."""
        if not so.structured_output_request_ids or so.grammar_bitmask is None:
            return None, None
        req_ids = so.structured_output_request_ids
        spec = so.scheduled_spec_decode_tokens
        batch = self.batch
        rows = np.fromiter((batch.req_id_to_row[req_id] for req_id in req_ids), dtype=np.int64, count=len(req_ids))
        counts = [len(spec.get(req_id, ())) for req_id in req_ids] if spec else [0] * len(req_ids)
        num_rows = len(req_ids) + sum(counts)
        # A writable copy: torch refuses to wrap the read-only view np.frombuffer gives of bytes.
        words = np.frombuffer(so.grammar_bitmask, dtype=np.int32).reshape(num_rows, -1).copy()
        if not any(counts):
            return (self.to_device(rows), self.to_device(words)), None
        # Where each batch row's drafts begin among the step's draft positions.
        per_row = np.fromiter((len(spec.get(req_id, ())) for req_id in batch.req_ids), dtype=np.int64,
                              count=batch.num_reqs)
        draft_start = np.cumsum(per_row) - per_row
        first = np.cumsum([0] + [1 + count for count in counts[:-1]])  # [G] each request's first mask row
        word_rows = np.concatenate([np.arange(start + 1, start + 1 + count) for start, count in zip(first, counts)])
        positions = np.concatenate([np.arange(draft_start[row], draft_start[row] + count)
                                    for row, count in zip(rows, counts)])
        return ((self.to_device(rows), self.to_device(words[first])),
                (self.to_device(positions), self.to_device(words[word_rows])))

    def sampling_metadata(self, inputs: StepInputs) -> SamplingMetadata:
        """The step's sampling metadata, one row per request in batch order."""
        batch = self.batch
        if self._sampling_version != batch.version:
            # None: the rows changed and changed back (a request unscheduled for a step and
            # scheduled again into its old row), so the tensors are still right.
            batch_update = batch.take_batch_update()
            if batch_update is not None:
                self.sampling_tensors.update_batch([s.sampling_params for s in batch.states],
                                                   [s.sampling_prompt_token_ids for s in batch.states], batch_update)
            self._sampling_version = batch.version
        sampling_metadata = self.sampling_tensors.metadata([s.output_token_ids for s in batch.states])
        sampling_metadata.grammar_bitmask = inputs.grammar_bitmask
        return sampling_metadata

    def sample(self, hidden_states: torch.Tensor, inputs: StepInputs,
               defer: bool = False) -> ModelRunnerOutput | DeferredStepOutput:
        if defer and not inputs.spec_decode_tokens and self.proposer is None:
            return self.sample_deferred(hidden_states, inputs)
        if inputs.spec_decode_tokens:
            sampled_token_ids, logprobs = verify_drafts(self.runner, hidden_states, inputs)
        else:
            sampled_token_ids, logprobs = self.sample_tokens(hidden_states, inputs)
        output = ModelRunnerOutput(
            req_ids=list(self.batch.req_ids), sampled_token_ids=sampled_token_ids, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs(hidden_states, inputs),
        )
        if self.proposer is not None:
            output.spec_token_ids = propose_drafts(self.runner, sampled_token_ids, hidden_states, inputs)
        return output

    def _sample_rows(self, hidden_states: torch.Tensor, inputs: StepInputs) -> tuple[Any, torch.Tensor]:
        """The plain path's sampler run: its output and the agreed sampled tokens [num_reqs]."""
        logits = self.model.compute_logits(hidden_states[inputs.logits_indices])  # [num_reqs, vocab]
        sampler_output = self.sampler(logits, self.sampling_metadata(inputs))
        return sampler_output, self.agree_on_sampled(sampler_output.sampled_token_ids)

    def sample_tokens(self, hidden_states: torch.Tensor,
                      inputs: StepInputs) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
        """One token per row that completed its tokens (the plain path, without drafts)."""
        batch = self.batch
        sampler_output, sampled = self._sample_rows(hidden_states, inputs)
        tokens = sampled.tolist()
        rows = np.flatnonzero(inputs.complete_rows).tolist()
        for row in rows:
            batch.states[row].output_token_ids.append(tokens[row])
            batch.append_token(row, tokens[row])
        return sampled_lists(batch.req_ids, rows, tokens, sampler_output.logprobs_lists())

    def sample_deferred(self, hidden_states: torch.Tensor, inputs: StepInputs) -> DeferredStepOutput:
        """The plain path's sampling without reading the tokens: they stay pending on the device
        for the next step (sparrow.worker.deferred_tokens)."""
        batch = self.batch
        sampler_output, sampled = self._sample_rows(hidden_states, inputs)
        rows = np.flatnonzero(inputs.complete_rows)
        host, event, sampler_output.logprobs = self.token_copies.start(sampled, sampler_output.logprobs)
        pending = PendingTokens(sampled, host, event, [batch.states[row] for row in rows.tolist()], rows)
        if rows.size:
            self._pending = pending
        return DeferredStepOutput(list(batch.req_ids), pending, sampler_output,
                                  self.prompt_logprobs(hidden_states, inputs))

    def agree_on_sampled(self, sampled_token_ids: torch.Tensor) -> torch.Tensor:
        """Tensor parallel: make rank 0's sampled tokens every rank's tokens.

        Every rank computes the same logits (the LM head all-gathers them) and seeds its sampler
        the same way, so ranks normally agree already; but each rank appends its own draw to its
        persistent batch, and one diverging draw (a different random stream, a non-deterministic
        kernel) would silently feed different tokens into the next step's collectives. Only rank
        0's output reaches the scheduler, so its choice is made authoritative. One tiny broadcast
        per step; nothing for a single device.
        """
        tp = getattr(self.model, "tp", None)
        if tp is None or tp.world_size == 1:
            return sampled_token_ids
        return tp.broadcast_from_first(sampled_token_ids.contiguous())

    def prompt_logprobs(self, hidden_states: torch.Tensor, inputs: StepInputs) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of the prompt tokens whose preceding position was computed this step."""
        out: dict[str, list[TokenLogprobs]] = {}
        qsl = inputs.metadata.query_start_loc_cpu
        assert qsl is not None  # prepare_inputs sets it
        for row, state in enumerate(self.batch.states):
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = int(self.batch.num_computed_tokens[row] - inputs.num_scheduled[row])  # first position this step
            stop = min(start + int(inputs.num_scheduled[row]), len(state.prompt_token_ids) - 1)
            if stop <= start:
                continue
            flat = int(qsl[row])
            logits = self.model.compute_logits(hidden_states[flat : flat + stop - start])
            chosen = torch.tensor(state.prompt_token_ids[start + 1 : stop + 1], device=logits.device)
            out[state.req_id] = compute_token_logprobs(logits.log_softmax(dim=-1), chosen, k)
        return out
