"""vLLM's newer per-request fields, as the input processor resolves them (each refusal an
``InvalidArgumentError`` naming the field):

- ``thinking_token_budget``: the reasoning's markers for the request, from the engine's reasoning
  parser (``SamplingParams.thinking_markers``); the worker's ``ThinkingBudgetLogitsProcessor``
  counts the tokens inside the reasoning and forces its end marker once the budget is spent.
- ``logprob_token_ids``: checked against the vocabulary and ``max_logprobs``; a request that sets
  them reports logprobs (``logprobs`` 0 when unset: the sampled token, then these ids).
"""

from __future__ import annotations

from typing import Any

from sparrow.errors import InvalidArgumentError
from sparrow.sampling_options import ThinkingMarkers


def thinking_markers(parser: Any, prompt_token_ids: list[int], name: str, params: Any) -> ThinkingMarkers | None:
    """The markers of a request with a thinking_token_budget (None without one); an
    InvalidArgumentError naming thinking_token_budget when the engine cannot bound its reasoning."""
    if params.thinking_token_budget is None:
        return None
    if parser is None:
        raise InvalidArgumentError(f"thinking_token_budget needs the engine's reasoning_parser (it tells where the "
                                   f"reasoning starts and ends), and this engine has none ({name})",
                                   "thinking_token_budget")
    markers = parser.thinking_markers(prompt_token_ids)
    if markers is None:
        raise InvalidArgumentError(f"thinking_token_budget: the reasoning parser {type(parser).__name__} cannot tell "
                                   f"where the reasoning ends ({name})", "thinking_token_budget")
    return markers


def logprob_token_ids_changes(params: Any, max_logprobs: int, name: str) -> dict[str, Any]:
    """The SamplingParams changes logprob_token_ids need: none without them, else ``logprobs=0``
    when the request asked for no top logprobs (their ids were checked against the vocabulary
    with the other token-id fields)."""
    token_ids = params.logprob_token_ids
    if not token_ids:
        return {}
    if len(token_ids) > max_logprobs:
        raise InvalidArgumentError(f"logprob_token_ids: {len(token_ids)} ids exceed the maximum of {max_logprobs} "
                                   f"(the engine argument max_logprobs) ({name})", "logprob_token_ids")
    return {"logprobs": 0} if params.logprobs is None else {}
