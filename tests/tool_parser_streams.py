"""Feeding a tool parser its text in pieces and reassembling what it sends as a client would,
shared by the tool-parser tests (tests/test_tool_calling.py, tests/test_tool_parser_*.py).

The reassembly checks OpenAI's delta shape on the way: a call opens (in index order) with its id
and name, and every later delta of it carries argument text only.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


def random_pieces(text: str, rng: random.Random, most: int = 12) -> list[str]:
    """``text`` cut at 1 to ``most`` random places (fewer for a short text)."""
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(1, most))))
    return [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]


def is_default_id(call_id: str | None) -> bool:
    return bool(call_id) and call_id.startswith("chatcmpl-tool-")  # type: ignore[union-attr]


def reassemble(parser: Any, pieces: list[str], id_ok: Callable[[str | None], bool] = is_default_id
               ) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed ``pieces`` then finish; the content (None when empty) and the calls as
    [(name, arguments)], in order. ``id_ok`` checks each call's id."""
    content, calls = "", {}
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            if call.index not in calls:
                assert id_ok(call.id) and call.name, call
                assert call.index == len(calls)  # calls open in order
                calls[call.index] = [call.name, ""]
            else:
                assert call.id is None and call.name is None, call
            calls[call.index][1] += call.arguments
    return content or None, [tuple(calls[index]) for index in sorted(calls)]  # type: ignore[misc]
