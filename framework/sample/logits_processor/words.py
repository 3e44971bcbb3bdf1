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
