"""The simulated device (``device="sim"``): the real engine core, scheduler, KV cache manager and
prefix cache over a worker whose forward is a roofline cost model of a named accelerator
(``sparrow.sim.gpus``), driven on simulated time by ``sparrow.sim.driver``.

The platform is registered by the kernel itself (``sparrow.kernel_components``); this package
imports nothing heavy until a driver or a worker is used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RequestTiming", "SimRequest", "SimResult", "simulate"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from sparrow.sim import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'sparrow.sim' has no attribute {name!r}")
