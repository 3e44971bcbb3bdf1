"""The CPU platform's C++ kernels, compiled on first use.

* ``paged_attention`` (``native_attention.py``): decode attention straight through the block table.
* element-wise layers (``native_elementwise.py``): RMSNorm, residual add + RMSNorm, rotary
  embedding and SiLU-and-mul, each one pass over memory instead of several torch ops.

They are built with ``torch.utils.cpp_extension.load_inline`` (gcc, ninja) as one extension, in a
directory keyed by torch, compiler, Python, CPU and source (``sparrow_cpu.kernel_build``), so each
combination compiles them once (about 40 s) and later loads skip the build tools. Each accessor
returns None when the build is impossible (no compiler) or when its switch is off, and the callers
then use plain torch:

* ``SPARROW_CPU_NATIVE=0``: no C++ at all;
* ``SPARROW_CPU_NATIVE_ATTENTION=0``: torch decode attention;
* ``SPARROW_CPU_NATIVE_OPS=0``: torch element-wise layers.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

from sparrow_cpu.kernel_build import KernelBuild, load_kernels

logger = logging.getLogger(__name__)

FUNCTIONS = ["paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_neox", "silu_and_mul"]


def _enabled(variable: str) -> bool:
    return os.environ.get("SPARROW_CPU_NATIVE", "1") != "0" and os.environ.get(variable, "1") != "0"


def kernel_build() -> KernelBuild:
    from sparrow_cpu import native_attention, native_elementwise

    return KernelBuild(name="sparrow_cpu_kernels",
                       sources=(native_attention.SOURCE, native_elementwise.SOURCE),
                       functions=tuple(FUNCTIONS),
                       cflags=("-O3", "-march=native", "-fopenmp", "-ffast-math"),
                       ldflags=("-fopenmp",))


@functools.lru_cache(maxsize=1)
def _load() -> Any:
    if os.environ.get("SPARROW_CPU_NATIVE", "1") == "0":
        return None
    try:
        return load_kernels(kernel_build())
    except Exception as exc:  # noqa: BLE001 - any build failure falls back to plain torch
        logger.warning("CPU C++ kernels unavailable, using plain torch: %s", exc)
        return None


def get_paged_attention() -> Callable[..., None] | None:
    """``paged_attention(query, kv_cache, out, rows, row_req, query_start_loc, seq_lens,
    block_table, scale, window, soft_cap)`` writing ``out[rows]`` (``window``/``soft_cap`` 0: off),
    or None when the kernel cannot be built."""
    module = _load() if _enabled("SPARROW_CPU_NATIVE_ATTENTION") else None
    return None if module is None else module.paged_attention


def get_elementwise_ops() -> Any | None:
    """The module with ``rms_norm``, ``fused_add_rms_norm``, ``rotary_neox`` and ``silu_and_mul``,
    or None (see the module docstring)."""
    return _load() if _enabled("SPARROW_CPU_NATIVE_OPS") else None
