"""``bad_words`` -> token-id sequences, in the frontend (no torch): vLLM's rule.

A word can start the text or follow a space, and most tokenizers spell those two differently
("Paris" vs " Paris"). So each word, stripped of leading whitespace, is encoded without special
tokens twice: as it is, and after one space. The spaced form is banned as well when it is a
different word-start token of the same length (a tokenizer that merely prepends a separate space
token would otherwise ban the space).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bad_words_token_ids(tokenizer: Any, words: Sequence[str], vocab_size: int) -> list[list[int]]:
    """Token-id sequences to ban for ``words``; ValueError naming ``bad_words[i]`` for a word that
    encodes to nothing or to ids outside the model's vocabulary."""
    sequences: list[list[int]] = []
    for index, word in enumerate(words):
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ValueError(f"bad_words[{index}]: {word!r} encodes to no tokens")
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        candidates = [bare]
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            candidates.append(spaced)
        for ids in candidates:
            outside = [token_id for token_id in ids if not 0 <= token_id < vocab_size]
            if outside:
                raise ValueError(f"bad_words[{index}]: {word!r} encodes to token ids {outside} outside the "
                                 f"vocabulary [0, {vocab_size})")
            if ids not in sequences:
                sequences.append(ids)
    return sequences


def request_bad_words(tokenizer: Any, vocab_size: int, name: str, params: Any) -> list[list[int]] | None:
    """The token-id sequences a request bans: its ``bad_words`` tokenized (vLLM's rule), then any
    ``bad_words_token_ids`` given; InvalidArgumentError naming the field (``name`` is the prompt's)."""
    from sparrow.engine.text_checks import check_text
    from sparrow.errors import InvalidArgumentError

    sequences: list[list[int]] = []
    if params.bad_words:
        if tokenizer is None:
            raise InvalidArgumentError(f"bad_words need a tokenizer, and this engine has none; pass "
                                       f"bad_words_token_ids ({name})", "bad_words")
        check_text("bad_words", params.bad_words)
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
