"""A request's ``bad_words`` as the token-id sequences the engine bans (frontend, no torch)."""

from __future__ import annotations

from typing import Any

from sparrow.engine.text_checks import check_text
from sparrow.errors import InvalidArgumentError


def request_bad_words(tokenizer: Any, vocab_size: int, name: str, params: Any) -> list[list[int]] | None:
    """The token-id sequences a request bans: its ``bad_words`` tokenized (vLLM's rule), then any
    ``bad_words_token_ids`` given; InvalidArgumentError naming the field (``name`` is the prompt's)."""
    sequences: list[list[int]] = []
    if params.bad_words:
        if tokenizer is None:
            raise InvalidArgumentError(f"bad_words need a tokenizer, and this engine has none; pass "
                                       f"bad_words_token_ids ({name})", "bad_words")
        check_text("bad_words", params.bad_words)
        from sparrow.sample.logits_processor.words import bad_words_token_ids

        sequences = bad_words_token_ids(tokenizer, params.bad_words, vocab_size)
    for index, ids in enumerate(params.bad_words_token_ids or []):
        for token_id in ids:
            if token_id >= vocab_size:
                where = f"bad_words_token_ids[{index}]"
                raise InvalidArgumentError(f"{where}: token id {token_id} is outside the vocabulary "
                                           f"[0, {vocab_size}) ({name})", where)
        if ids not in sequences:
            sequences.append(list(ids))
    return sequences or None
