"""Speculative decoding: proposers guess the next tokens, the target model checks them all in one
forward pass, and a rejection sampler keeps the target's distribution exactly.

Who does what (vLLM V1's split):

* the worker proposes after each step's sampling (``sparrow.spec_decode.proposer``; the built-in
  ``ngram`` copies what followed the last n-gram earlier in the context, ``draft_model`` runs a
  smaller model with a KV cache of its own, ``eagle`` a head on the target's hidden states) and
  returns the drafts in ``ModelRunnerOutput.spec_token_ids``;
* the scheduler budgets them in the next step (``1 + k`` tokens and KV slots for a request with k
  drafts), sends them as ``SchedulerOutput.scheduled_spec_decode_tokens``, and after the step
  rolls ``num_computed_tokens`` back by the rejected ones;
* the worker verifies (``sparrow.spec_decode.rejection_sampler``) and appends the accepted drafts
  plus one token of its own.

This module stays light (no torch): the engine configuration imports its validation.
"""

from sparrow.spec_decode.config import SpeculativeConfig, parse_speculative_config  # noqa: F401
