"""Choosing each op's implementation once: per layer when a model is built, per sampler for
function ops, and the table ``sparrow plugins`` prints."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from sparrow.ops import KERNEL_OPS

if TYPE_CHECKING:
    from torch import nn

    from sparrow.ops.base import OpImpl

logger = logging.getLogger(__name__)

NATIVE = "native"


def _registry(registry: Any) -> Any:
    if registry is None:
        from sparrow.plugins import get_registry

        registry = get_registry()
    return registry


def lookup_impl(op_name: str, platform: str, registry: Any = None) -> Any:
    """The implementation registered for ``op_name`` on ``platform`` (imported), or None."""
    from sparrow.plugins import import_object

    entry = _registry(registry).ops.get(op_name, {}).get(platform)
    if isinstance(entry, str):
        entry = import_object(entry)
    return entry


def bind_ops(model: nn.Module, platform: str, registry: Any = None,
             overrides: dict[str, type[OpImpl]] | None = None) -> dict[str, Counter]:
    """Give every :class:`CustomOp` layer of ``model`` (weights loaded) the implementation
    ``platform`` registered for its op, running its weight post-processing once; layers no
    implementation supports keep the torch reference. ``overrides`` (op -> OpImpl class) win over
    the registry: how a quantization method serves ``linear``. Returns ``{op: Counter(impl name: layers)}``."""
    # torch is imported here, not at the top: ``sparrow plugins`` prints op_table without it.
    import torch

    from sparrow.ops.base import CustomOp

    registry = _registry(registry)
    chosen: dict[str, type[OpImpl] | None] = dict(overrides or {})
    summary: dict[str, Counter] = {}
    with torch.no_grad():  # weight post-processing is not part of any graph
        for module in model.modules():
            if not isinstance(module, CustomOp) or not module.op_name:
                continue
            op = module.op_name
            if op not in chosen:
                chosen[op] = _layer_impl(op, platform, lookup_impl(op, platform, registry))
            impl_cls = chosen[op]
            impl = None
            if impl_cls is not None and impl_cls.supports(module):
                impl = impl_cls(module)
                impl.process_weights()
            module.bind_impl(impl)
            summary.setdefault(op, Counter())[impl_name(impl_cls) if impl is not None else NATIVE] += 1
    logger.debug("ops bound on %s: %s", platform, {op: dict(c) for op, c in summary.items()})
    return summary


def _layer_impl(op: str, platform: str, impl: Any) -> type[OpImpl] | None:
    from sparrow.ops.base import OpImpl

    if impl is None or (isinstance(impl, type) and issubclass(impl, OpImpl)):
        return impl
    raise TypeError(f"the implementation of layer op {op!r} registered for platform {platform!r} must be a "
                    f"sparrow.ops.OpImpl subclass, got {impl!r}")


def resolve_function_op(op_name: str, platform: str, registry: Any = None) -> Callable[..., Any]:
    """The function serving function op ``op_name`` on ``platform``: a registered one, else the
    torch reference."""
    from sparrow.plugins import import_object

    spec = KERNEL_OPS[op_name]
    if spec.kind != "function":
        raise ValueError(f"op {op_name!r} is a layer op; bind it with bind_ops")
    impl = lookup_impl(op_name, platform, registry)
    if impl is None:
        return import_object(spec.reference)
    if not callable(impl):
        raise TypeError(f"the implementation of function op {op_name!r} registered for platform {platform!r} "
                        f"must be a function, got {impl!r}")
    return impl


def impl_name(impl: Any) -> str:
    if impl is None:
        return NATIVE
    name = getattr(impl, "name", "") if isinstance(impl, type) else ""
    return name or getattr(impl, "__qualname__", None) or repr(impl)


def op_table(platforms: list[str], registry: Any = None) -> list[tuple[str, dict[str, str]]]:
    """``[(op, {platform: implementation})]`` for every kernel op; "native" where none is
    registered (the import path where it is registered but not imported)."""
    registry = _registry(registry)
    rows = []
    for op in KERNEL_OPS:
        per_platform = {}
        for platform in platforms:
            entry = registry.ops.get(op, {}).get(platform)
            per_platform[platform] = entry if isinstance(entry, str) else impl_name(entry)
        rows.append((op, per_platform))
    return rows
