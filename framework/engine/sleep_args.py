"""Sleep mode's arguments (``sleep(level)``, ``wake_up(tags)``), checked where they are given:
in the frontend and in the engine core, neither of which may import torch for it (the engine
core process configures OpenMP before torch loads). The worker's side is
:mod:`sparrow.worker.sleep_mode`.
"""

from __future__ import annotations

from typing import Any

SLEEP_TAGS = ("weights", "kv_cache")


def check_sleep(config: Any, level: Any) -> None:
    """ValueError naming ``enable_sleep_mode`` or ``level`` when ``sleep(level)`` cannot run."""
    if not config.model.enable_sleep_mode:
        raise ValueError("sleep() needs an engine started with enable_sleep_mode=True")
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"sleep: level must be 1 (offload the weights, discard the KV cache) or 2 (discard "
                         f"both), got {level!r}")


def check_wake_up_tags(tags: Any) -> list[str] | None:
    """``wake_up``'s tags as a list (None: every tag); ValueError naming ``tags``."""
    if tags is None:
        return None
    if isinstance(tags, str) or not isinstance(tags, (list, tuple, set)) \
            or not all(tag in SLEEP_TAGS for tag in tags):
        raise ValueError(f"wake_up: tags must be a list of {', '.join(map(repr, SLEEP_TAGS))} (or None for both), "
                         f"got {tags!r}")
    return list(tags)
