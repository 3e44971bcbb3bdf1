"""Text a request carries must be valid Unicode: a lone surrogate (``"\\ud800"``), which Python
strings and JSON's ``\\u`` escapes allow but UTF-8 cannot encode, is refused with an
``InvalidArgumentError`` naming where it is (``messages[0].content``), by the offline ``LLM`` and
the server alike, before any tokenizer sees it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparrow.errors import InvalidArgumentError


def find_unencodable(value: Any, path: str) -> tuple[str, str] | None:
    """The path and text of the first string in ``value`` (a string, or mappings, sequences and
    pydantic models nesting them, keys included) that UTF-8 cannot encode; None if there is none.
    Paths read like ``messages[0].content``. Iterative: a request may nest deeper than Python's
    recursion limit."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where, item
            continue
        if hasattr(type(item), "model_fields") and hasattr(item, "model_extra"):  # a pydantic model
            item = {**{name: getattr(item, name) for name in type(item).model_fields}, **(item.model_extra or {})}
        children: list[tuple[Any, str]] = []
        if isinstance(item, Mapping):
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else str(key)
                children += [(key, child_path), (child, child_path)]
        elif isinstance(item, (list, tuple)):
            # Token-id lists can be millions long; only strings can be unencodable.
            children = [(child, f"{where}[{index}]") for index, child in enumerate(item) if type(child) is not int]
        stack.extend(reversed(children))  # depth first, in order: the first bad string is reported
    return None


def check_text(field: str, value: Any, label: str | None = None) -> None:
    """Raise an InvalidArgumentError for the path inside ``field`` where ``value`` holds text
    UTF-8 cannot encode. The message starts with that path, or with ``label`` when the text is
    ``value`` itself (``prompt of request 'x'``)."""
    found = find_unencodable(value, field)
    if found is None:
        return
    path, text = found
    position = next(index for index, char in enumerate(text) if 0xD800 <= ord(char) <= 0xDFFF)
    shown = label if label is not None and path == field else path
    raise InvalidArgumentError(f"{shown}: not valid Unicode text: a lone surrogate {text[position]!r} at character "
                               f"{position}; send UTF-8 text (a surrogate pair must be complete)", path)
