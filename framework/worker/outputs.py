"""What a worker returns after a step (msgspec, crosses processes; no torch)."""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """Logprobs at one position: the chosen token first, then the top-k (k may be 0).

    ``ranks[i]`` is the 1-based rank of ``token_ids[i]`` in the full distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    # Requests of the step, in batch order.
    req_ids: list[str] = []
    # One list per request: the sampled token ids, empty while a prefill is still partial.
    sampled_token_ids: list[list[int]] = []
    # req_id -> logprobs of each sampled token (only requests that asked for logprobs).
    logprobs: dict[str, list[TokenLogprobs]] = {}
    # req_id -> logprobs of the prompt positions computed this step (prompt_logprobs requests).
    # Position i holds the logprob of prompt token i+1 given tokens [0..i].
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # Set by KV connectors: requests whose asynchronous KV save/load finished.
    finished_sending: list[str] = []
    finished_recving: list[str] = []
