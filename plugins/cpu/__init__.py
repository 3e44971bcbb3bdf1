"""The built-in CPU platform: torch on the host, paged KV cache in RAM."""

from __future__ import annotations

from sparrow.hookspecs import hookimpl
from sparrow_cpu.ops import sparrow_register_ops  # noqa: F401 - a hookimpl of this plugin module

# The hook-contract versions this plugin supports (sparrow.hookspecs.CONTRACT_VERSION).
SPARROW_CONTRACT = ">=1.0,<2"


def detect() -> str | None:
    """A CPU is always present."""
    return "sparrow_cpu.platform:CpuPlatform"


@hookimpl
def sparrow_register_platforms(register) -> None:
    register("cpu", detect, priority=0)


@hookimpl
def sparrow_attention_backend(platform, requested: str):
    if platform.name != "cpu":
        return None
    if requested not in ("auto", "torch"):
        raise ValueError(f"attention_backend {requested!r} is not available on cpu; choose 'auto' or 'torch'")
    from sparrow_cpu.attention import TorchPagedAttention

    return TorchPagedAttention
