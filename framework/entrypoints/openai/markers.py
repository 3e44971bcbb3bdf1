"""Finding marker strings (``<think>``, ``<tool_call>``) in text that arrives in pieces.

A stream may end a delta in the middle of a marker (``"... <tool_"``): what could still become a
marker is held back until the next delta tells, so that no piece of a marker ever reaches the
client as text, whatever the chunking.
"""

from __future__ import annotations


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (0 if none):
    the part of ``text`` to hold back because the next delta may complete the marker."""
    longest = min(len(text), len(marker) - 1)
    for size in range(longest, 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def opens_with(text: str, marker: str, *, final: bool) -> bool | None:
    """Whether ``text``, after leading whitespace, starts with ``marker``: True, False, or None
    while it cannot tell yet (only whitespace, or a prefix of the marker, and more may come)."""
    stripped = text.lstrip()
    if stripped.startswith(marker):
        return True
    if not final and marker.startswith(stripped):
        return None
    return False
