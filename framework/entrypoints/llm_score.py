"""``LLM.score`` for embedding models (vLLM's bi-encoder scoring): each text is embedded once and
a pair's score is the cosine similarity of its two vectors.

Pairs as vLLM forms them: one text against each of the others (1 -> N), or the texts of two
lists of the same length side by side (N -> N). Cross-encoder rerankers (a classification head
over both texts at once) are not supported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sparrow.errors import InvalidArgumentError
from sparrow.outputs import ScoringOutput, ScoringRequestOutput


def _as_list(data: Any, field: str) -> list[Any]:
    if isinstance(data, (str, Mapping)):
        return [data]
    if isinstance(data, Sequence) and not isinstance(data, bytes):
        if not data:
            raise InvalidArgumentError(f"{field} is empty; score needs at least one text", field)
        return list(data)
    raise InvalidArgumentError(f"{field} must be a text, a prompt dict or a list of them, got {type(data).__name__}",
                               field)


def pair_up(data_1: Any, data_2: Any) -> list[tuple[int, int]]:
    """(index in data_1, index in data_2) of every pair, in output order."""
    first, second = _as_list(data_1, "data_1"), _as_list(data_2, "data_2")
    if len(first) == 1:
        return [(0, index) for index in range(len(second))]
    if len(first) != len(second):
        raise InvalidArgumentError(f"data_1 has {len(first)} texts and data_2 {len(second)}: score pairs one text "
                                   "with many, or two lists of the same length", "data_1")
    return [(index, index) for index in range(len(first))]


def score(llm: Any, data_1: Any, data_2: Any, **encode_kwargs: Any) -> list[ScoringRequestOutput]:
    """The cosine similarity of each pair's embeddings (``encode_kwargs`` go to ``LLM.encode``)."""
    import torch

    pairs = pair_up(data_1, data_2)
    first, second = _as_list(data_1, "data_1"), _as_list(data_2, "data_2")
    outputs = llm.encode(first + second, pooling_task="embed", **encode_kwargs)
    vectors_1, vectors_2 = outputs[: len(first)], outputs[len(first):]
    results = []
    for i, j in pairs:
        a, b = vectors_1[i], vectors_2[j]
        similarity = torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)
        results.append(ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(float(similarity)),
                                            list(a.prompt_token_ids) + list(b.prompt_token_ids), True))
    return results
