"""An out-of-tree Sparrow platform: ``device="cpu_sdpa"``.

This module is what the ``sparrow`` entry point names, so it is imported in every process that
loads plugins (the frontend too, and ``sparrow plugins``). It must stay cheap: no torch here; the
worker, the attention backend and the op implementation (``ops.py``) are imported only when the
platform is actually used.
"""

from __future__ import annotations

import importlib.util

from sparrow.hookspecs import hookimpl

# The hook-contract versions (sparrow.hookspecs.CONTRACT_VERSION) this plugin was written for: a
# Sparrow outside the range refuses to load it, with a message, instead of failing mid-request.
SPARROW_CONTRACT = ">=1.0,<2"
PLATFORM_NAME = "cpu_sdpa"
ATTENTION_BACKENDS = ("auto", "sdpa")


def detect() -> str | None:
    """The platform's import path when its device is usable, else None.

    A real accelerator plugin checks for its driver or runtime here without initialising it
    (a device node, ``importlib.util.find_spec("torch_npu")``); this one needs only torch, and
    ``find_spec`` answers that without importing it.
    """
    if importlib.util.find_spec("torch") is None:
        return None
    return "sparrow_example_platform.platform:CpuSdpaPlatform"


@hookimpl
def sparrow_register_platforms(register) -> None:
    # Below the built-in cpu (0): device="auto" keeps choosing the built-in platform, and this
    # one serves only those who ask for it by name.
    register(PLATFORM_NAME, detect, priority=-10)


@hookimpl
def sparrow_register_ops(register) -> None:
    # By import path: the module (and torch) loads only in a process that builds a model on this
    # platform. Every op not registered here is served by the kernel's torch reference.
    register("rms_norm", PLATFORM_NAME, "sparrow_example_platform.ops:TorchRMSNorm")


@hookimpl
def sparrow_attention_backend(platform, requested: str):
    if platform.name != PLATFORM_NAME:
        return None  # another platform's worker: let its plugin answer
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend {requested!r} is not available on {PLATFORM_NAME}; "
            f"choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    from sparrow_example_platform.attention import GatherSdpaAttention

    return GatherSdpaAttention
