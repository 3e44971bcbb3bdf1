"""vLLM's ``thinking_token_budget``, frontend half: the reasoning's markers for a request, from
the engine's reasoning parser (``SamplingParams.thinking_markers``). The worker's
``ThinkingBudgetLogitsProcessor`` counts the tokens inside the reasoning and forces its end marker
once the budget is spent."""

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
