"""vLLM's conversion of a causal LM into a sequence classifier through ``classifier_from_token``:
LLM rerankers such as Qwen3-Reranker, served without a classification checkpoint.

The causal LM's checkpoint is run as a ``*ForSequenceClassification`` architecture (set through
``hf_overrides``) whose ``score`` layer is built from LM-head rows of the named tokens, as vLLM
builds it (its ``method``):

    from_2_way_softmax   two tokens ``[false, true]``: one label, the row of ``true`` minus the row
                         of ``false``, so that its sigmoid is the softmax of the two tokens'
                         logits at the last position (Qwen3-Reranker, mxbai-rerank-v2)
    no_post_processing   one label per token: the tokens' rows as they are (their raw logits)

``is_original_qwen3_reranker: true`` stands for ``from_2_way_softmax``. For Qwen3-Reranker::

    LLM("Qwen/Qwen3-Reranker-0.6B", hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True})

``apply_conversion_config`` runs on every config read with the overrides (frontend and workers
alike) and sets ``num_labels``; the model loader builds the rows (``score_rows``) with the token
ids ``classifier_token_ids`` reads from the tokenizer. Pure Python here; torch where rows are built.
"""

from __future__ import annotations

from typing import Any

METHODS = ("from_2_way_softmax", "no_post_processing")


def _error(key: str, message: str) -> ValueError:
    from sparrow.config import ConfigError

    return ConfigError(f"invalid engine argument 'hf_overrides': {key} {message}")


def conversion_method(hf_config: Any) -> str | None:
    """The config's ``method`` (None: a classifier checkpoint with a score layer of its own)."""
    method = getattr(hf_config, "method", None)
    if method is None and getattr(hf_config, "is_original_qwen3_reranker", False):
        return "from_2_way_softmax"
    return method


def apply_conversion_config(hf_config: Any) -> None:
    """Check a conversion's settings and set ``num_labels`` from them (nothing without one).
    Raises ConfigError naming the hf_overrides key."""
    method = conversion_method(hf_config)
    tokens = getattr(hf_config, "classifier_from_token", None)
    if method is None and tokens is None:
        return
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures or not architectures[0].endswith("ForSequenceClassification"):
        raise _error("classifier_from_token", f"turns a causal LM into a sequence classifier, and the architecture is "
                     f"{architectures[0] if architectures else '(none)'}: also set hf_overrides architectures to its "
                     "*ForSequenceClassification name (e.g. Qwen3ForSequenceClassification)")
    if method is None:
        raise _error("method", f"is needed with classifier_from_token: one of {', '.join(METHODS)} (or "
                     "is_original_qwen3_reranker: true for from_2_way_softmax)")
    if method not in METHODS:
        raise _error("method", f"must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(tokens, (list, tuple)) or not tokens or \
            not all(isinstance(token, str) and token for token in tokens):
        raise _error("classifier_from_token", f"must be a non-empty list of token strings, got {tokens!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise _error("classifier_from_token", f"must be two tokens [false, true] for from_2_way_softmax, "
                     f"got {tokens!r}")
    hf_config.method = method
    hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)


def classifier_token_ids(tokenizer: Any, tokens: list[str]) -> list[int]:
    """Each token's id in ``tokenizer``; ConfigError naming ``classifier_from_token`` for a token
    the vocabulary does not hold as one token."""
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise _error("classifier_from_token", f"names {token!r}, which is not one token of the model's vocabulary "
                         "(write it as the tokenizer spells it, e.g. with its leading-space marker)")
        ids.append(token_id)
    return ids


def tokenizer_for(model_config: Any) -> Any:
    """The model's tokenizer, as the engine loads it (its directory, revision, remote code)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer or model_config.model, local_files_only=True,
                                         trust_remote_code=bool(model_config.trust_remote_code))


def score_rows(lm_head: Any, method: str, token_ids: list[int]) -> Any:
    """The score layer's weight [num_labels, hidden] from the LM head's (or the tied embedding's)
    rows, in float32. ``lm_head`` is a tensor or a lazy safetensors slice (rows are read one by one)."""
    import torch

    rows = [torch.as_tensor(lm_head[token_id:token_id + 1]).to(torch.float32) for token_id in token_ids]
    if method == "from_2_way_softmax":
        false_row, true_row = rows
        return true_row - false_row
    return torch.cat(rows)
