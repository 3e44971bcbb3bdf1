"""The built-in logits processors, registered through the same hook a plugin uses.

The kernel registers this module as a plugin (``sparrow.plugins.KERNEL_PLUGINS``). Classes are
named by import path, so loading plugins never imports torch.
"""

from __future__ import annotations

from typing import Callable

from sparrow.hookspecs import hookimpl

_MODULE = "sparrow.sample.logits_processor.builtin"
# name -> "module:Class", in the order they are applied. Always enabled; a plugin may replace one
# by registering the same name with override=True.
BUILTIN_LOGITS_PROCESSORS: tuple[tuple[str, str], ...] = (
    ("allowed_token_ids", f"{_MODULE}:AllowedTokenIdsLogitsProcessor"),
    ("bad_words", f"{_MODULE}:BadWordsLogitsProcessor"),
    ("min_tokens", f"{_MODULE}:MinTokensLogitsProcessor"),
    ("logit_bias", f"{_MODULE}:LogitBiasLogitsProcessor"),
    ("thinking_token_budget", f"{_MODULE}:ThinkingBudgetLogitsProcessor"),
)
BUILTIN_NAMES = tuple(name for name, _ in BUILTIN_LOGITS_PROCESSORS)


@hookimpl
def sparrow_register_logits_processors(register: Callable[..., None]) -> None:
    for name, import_path in BUILTIN_LOGITS_PROCESSORS:
        register(name, import_path)
