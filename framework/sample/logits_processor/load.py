"""Turning ``logits_processors`` names into classes and a worker's processor pipeline.

A name in ``logits_processors`` is either a name registered through the
``sparrow_register_logits_processors`` hook, or a qualified name ``"package.module:Class"``
(vLLM's form) importable in every process that builds processors. The built-ins are always
enabled, first. Torch is imported only when a processor class is.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sparrow.sample.logits_processor.registration import BUILTIN_NAMES

if TYPE_CHECKING:
    import torch

    from sparrow.config import EngineConfig
    from sparrow.plugins import Registry
    from sparrow.sample.logits_processor.state import LogitsProcessors


class LogitsProcessorLookupError(ValueError):
    """A ``logits_processors`` entry names no registered processor or importable class."""


def import_qualified(name: str) -> Any:
    """``"package.module:Outer.Inner"`` -> the object (nested class names are walked)."""
    module_name, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj


def _check_class(name: str, obj: Any) -> type:
    missing = [method for method in ("is_argmax_invariant", "update_state", "apply") if not hasattr(obj, method)]
    if not isinstance(obj, type) or missing:
        raise LogitsProcessorLookupError(
            f"{name!r} is not a logits processor class (it must subclass "
            f"sparrow.sample.logits_processor.LogitsProcessor{'; missing ' + ', '.join(missing) if missing else ''})")
    return obj


def resolve_class(name: str, registered: dict[str, Any]) -> type:
    """The processor class ``name`` stands for; LogitsProcessorLookupError saying why not."""
    if name in registered:
        target = registered[name]
        if isinstance(target, str):
            try:
                target = import_qualified(target)
            except Exception as exc:  # noqa: BLE001 - reported with the name that failed
                raise LogitsProcessorLookupError(f"{name!r} is registered as {registered[name]!r}, which failed to "
                                                 f"import: {exc!r}") from None
        return _check_class(name, target)
    if ":" in name:
        try:
            return _check_class(name, import_qualified(name))
        except LogitsProcessorLookupError:
            raise
        except Exception as exc:  # noqa: BLE001 - an import error, a missing attribute, ...
            hint = (" (a class defined in __main__ exists only in the process that ran the script; put it "
                    "in a module)" if name.startswith("__main__:") else "")
            raise LogitsProcessorLookupError(f"{name!r} cannot be imported: {exc!r}{hint}") from None
    custom = sorted(set(registered) - set(BUILTIN_NAMES))
    raise LogitsProcessorLookupError(
        f"unknown logits processor {name!r}; registered: {', '.join(custom) or 'none'} (the built-ins "
        f"{', '.join(BUILTIN_NAMES)} are always on), or give a qualified name 'package.module:Class'")


def enabled_names(requested: Sequence[str] | None) -> list[str]:
    """The built-ins, then the requested names in order, each once."""
    return list(dict.fromkeys([*BUILTIN_NAMES, *(requested or ())]))


def enabled_classes(requested: Sequence[str] | None, registry: Registry | None = None) -> list[type]:
    """The classes of every enabled processor (``requested``: the ``logits_processors`` setting)."""
    if registry is None:
        from sparrow.plugins import get_registry

        registry = get_registry()
    return [resolve_class(name, registry.logits_processors) for name in enabled_names(requested)]


def build_logits_processors(config: EngineConfig | None, device: torch.device, is_pin_memory: bool,
                            registry: Registry | None = None) -> LogitsProcessors:
    """A worker's pipeline: every enabled processor, built once."""
    from sparrow.sample.logits_processor.state import LogitsProcessors

    requested = config.model.logits_processors if config is not None else None
    try:
        classes = enabled_classes(requested, registry)
    except LogitsProcessorLookupError as exc:
        # The frontend checked the names in its own process; a worker is another process, which
        # sees only the plugins its entry points load.
        raise LogitsProcessorLookupError(
            f"logits_processors: {exc} (in the worker process: a plugin registered only in the calling "
            "process is not seen here; install it with an entry point or use 'package.module:Class')") from None
    return LogitsProcessors([cls(config, device, is_pin_memory) for cls in classes])


def builtin_logits_processors(device: torch.device | str) -> LogitsProcessors:
    """The built-ins alone, without the plugin registry (a sampler used on its own)."""
    import torch

    from sparrow.sample.logits_processor.builtin import BUILTIN_CLASSES
    from sparrow.sample.logits_processor.state import LogitsProcessors

    return LogitsProcessors([cls(None, torch.device(device), False) for cls in BUILTIN_CLASSES])
