"""Platform resolution: which registered platform serves ``device=``."""

from __future__ import annotations

import logging

from sparrow.platforms.interface import Platform
from sparrow.plugins import get_registry, import_object

logger = logging.getLogger(__name__)

__all__ = ["Platform", "available_platforms", "resolve_platform"]


def available_platforms() -> dict[str, str | None]:
    """platform name -> import path when its device is present, else None."""
    out: dict[str, str | None] = {}
    for name, entry in get_registry().platforms.items():
        try:
            out[name] = entry.detect()
        except Exception as exc:  # noqa: BLE001 - a broken detector must not break the others
            logger.warning("platform %s: detection failed: %r", name, exc)
            out[name] = None
    return out


def resolve_platform(device: str = "auto") -> Platform:
    """The platform for ``device``: a registered name, or "auto" for the best present one."""
    registry = get_registry()
    if device != "auto":
        entry = registry.platforms.get(device)
        if entry is None:
            raise ValueError(
                f"unknown device {device!r}; installed platforms: {', '.join(sorted(registry.platforms)) or 'none'}"
            )
        import_path = entry.detect()
        if import_path is None:
            raise RuntimeError(f"device {device!r} was requested but its platform plugin found no such device")
        return import_object(import_path)()
    present = [(entry.priority, name, path) for name, entry in registry.platforms.items()
               if (path := _safe_detect(entry)) is not None]
    if not present:
        raise RuntimeError(
            f"no platform found a device; installed platforms: {', '.join(sorted(registry.platforms)) or 'none'}"
        )
    _, name, import_path = max(present)
    logger.info("device=auto chose platform %s", name)
    return import_object(import_path)()


def _safe_detect(entry) -> str | None:
    try:
        return entry.detect()
    except Exception as exc:  # noqa: BLE001
        logger.warning("platform %s: detection failed: %r", entry.name, exc)
        return None
