"""The built-in CPU platform: torch on the host, paged KV cache in RAM."""

from __future__ import annotations

from sparrow.hookspecs import hookimpl


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


@hookimpl
def sparrow_execute_model(worker, scheduler_output):
    if worker.platform.name != "cpu":
        return None
    return worker.execute_model(scheduler_output)
