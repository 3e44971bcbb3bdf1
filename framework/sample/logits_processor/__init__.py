"""Batch-level logits processors (vLLM v1's interface): see ``interface.py`` for the contract.

Names are imported lazily, so that the plugin manager, which imports ``registration`` from this
package, never loads torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LogitsProcessor": "interface",
    "BatchUpdate": "interface",
    "MoveDirectionality": "interface",
    "AddedRequest": "interface",
    "MovedRequest": "interface",
    "process_dict_updates": "interface",
    "LogitsProcessors": "state",
    "build_logits_processors": "load",
    "BUILTIN_NAMES": "registration",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
