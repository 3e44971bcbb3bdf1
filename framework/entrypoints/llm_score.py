"""``LLM.score``: with an embedding model (vLLM's bi-encoder scoring) each text is embedded once
and a pair's score is the cosine similarity of its two vectors; with a cross-encoder (a
``*ForSequenceClassification`` checkpoint with one label) each pair is one prompt, the two
texts tokenized together as the tokenizer pairs them (``tokenizer(text_1, text_pair=text_2)``),
and its score is the classifier's output after the model's activation (sigmoid by default).

Pairs as vLLM forms them: one text against each of the others (1 -> N), or the texts of two
lists of the same length side by side (N -> N).
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


def pair_up(data_1: Any, data_2: Any) -> tuple[list[Any], list[Any], list[tuple[int, int]]]:
    """Both sides as lists, and (index in data_1, index in data_2) of every pair, in output order."""
    first, second = _as_list(data_1, "data_1"), _as_list(data_2, "data_2")
    if len(first) == 1:
        return first, second, [(0, index) for index in range(len(second))]
    if len(first) != len(second):
        raise InvalidArgumentError(f"data_1 has {len(first)} texts and data_2 {len(second)}: score pairs one text "
                                   "with many, or two lists of the same length", "data_1")
    return first, second, [(index, index) for index in range(len(first))]


def embedding_score(llm: Any, data_1: Any, data_2: Any, **encode_kwargs: Any) -> list[ScoringRequestOutput]:
    """The cosine similarity of each pair's embeddings (``encode_kwargs`` go to ``LLM.encode``)."""
    import torch

    first, second, pairs = pair_up(data_1, data_2)
    outputs = llm.encode(first + second, pooling_task="embed", **encode_kwargs)
    vectors_1, vectors_2 = outputs[: len(first)], outputs[len(first):]
    results = []
    for i, j in pairs:
        a, b = vectors_1[i], vectors_2[j]
        similarity = torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)
        results.append(ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(float(similarity)),
                                            list(a.prompt_token_ids) + list(b.prompt_token_ids), True))
    return results


def pair_token_ids(tokenizer: Any, text_1: Any, text_2: Any, index: int) -> list[int]:
    """The prompt a cross-encoder reads for one pair: both texts through the tokenizer at once."""
    for field, text in (("data_1", text_1), ("data_2", text_2)):
        if not isinstance(text, str):
            raise InvalidArgumentError(f"{field}: a cross-encoder reads both texts of a pair together, so each must "
                                       f"be a text; pair {index} has {type(text).__name__}", field)
    if tokenizer is None:
        raise InvalidArgumentError("a cross-encoder tokenizes each pair of texts, and this engine was started with "
                                   "skip_tokenizer_init=True", "skip_tokenizer_init")
    return list(tokenizer(text_1, text_pair=text_2).input_ids)


def cross_encoder_score(llm: Any, data_1: Any, data_2: Any, **encode_kwargs: Any) -> list[ScoringRequestOutput]:
    """A cross-encoder's score of each pair (``encode_kwargs`` go to ``LLM.encode``)."""
    first, second, pairs = pair_up(data_1, data_2)
    tokenizer = llm.llm_engine.tokenizer
    prompts = [{"prompt_token_ids": pair_token_ids(tokenizer, first[i], second[j], index)}
               for index, (i, j) in enumerate(pairs)]
    outputs = llm.encode(prompts, pooling_task="score", **encode_kwargs)
    return [ScoringRequestOutput(output.request_id, ScoringOutput(float(output.outputs.data[0])),
                                 list(output.prompt_token_ids), True) for output in outputs]
