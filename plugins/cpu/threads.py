"""How many threads a CPU engine process computes with, and how they wait between parallel regions.

torch's CPU kernels, oneDNN's matmuls and the C++ kernels' ``at::parallel_for`` all run on one
OpenMP team (libgomp in torch's Linux wheels). Left to its defaults, libgomp keeps a team thread
that has finished its share spinning for 300,000 iterations (about 3 ms) before it sleeps. A step
runs hundreds of short parallel regions, so that thread almost never sleeps. On a machine whose
cores are all wanted (the engine's threads plus the frontend, a test run or any neighbour process)
the spinning thread holds a core that the thread it waits for needs, and every region's barrier
waits for a time slice: on the 2-core VM the benchmark fell to a tenth beside one CPU-bound
process (docs/benchmarks.md has the figures). The engine's processes therefore spin for 5,000
iterations and then sleep, so that a waiting thread gives its core back. A spin is one ``pause``:
30 ns on the AMD EPYC VM, 16 ns on the Intel Xeon one, so 5,000 spins last 80-150 us, which covers
the serial gap before most parallel regions of a step (oneDNN spends 25-40 us preparing each
linear's primitive before its threads start). Measured on the Xeon VM: at 2,000 spins (32 us)
the threads fall asleep inside a layer (the int8 workload 13 % and fp32 6 % slower than at 5,000);
10,000 spins gain 7 % more for int8 and nothing for fp32; beside a CPU-bound neighbour the engine keeps 0.53 of
its quiet speed at 5,000 spins and 0.50 at 10,000 (on the EPYC VM 20,000 kept 0.37); sleeping
at once (``OMP_WAIT_POLICY=PASSIVE`` alone) cost 6-8 %: every region then wakes a sleeping thread.

libgomp reads its settings once, when it is loaded (with torch), so :func:`configure_openmp` must
run before the process imports torch: the engine-core process first imports torch through
``sparrow_cpu.worker``, which calls it before its own imports. A variable the user set wins.

Threads: ``SPARROW_CPU_THREADS`` if set, else the usable cores shared out between the engine
processes computing on this machine (data-parallel engines times local tensor-parallel ranks),
so that several of them never oversubscribe the cores.
"""

from __future__ import annotations

import os
import sys

from sparrow.executor.topology import core_share, usable_cores  # torch-free: safe before torch loads

ENV_CPU_THREADS = "SPARROW_CPU_THREADS"
# Set in the engine's processes unless the user chose how OpenMP waits (any of USER_WAIT_SETTINGS).
# libgomp: PASSIVE, then GOMP_SPINCOUNT spins before sleeping (0 when it counts more threads than
# cores); Intel's OpenMP reads PASSIVE as a block time of 0.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "5000"}
USER_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


def openmp_loaded() -> bool:
    """Whether an OpenMP runtime is already in this process (its settings can no longer change)."""
    try:
        with open("/proc/self/maps") as maps:
            return any(name in line for line in maps for name in _OPENMP_LIBRARIES)
    except OSError:  # not Linux: torch is what brings OpenMP in
        return "torch" in sys.modules


def configure_openmp() -> bool:
    """Give this process the engine's OpenMP wait policy unless the user chose one.

    Returns True when the settings were in place before OpenMP loaded, False when it is too
    late (torch was imported first, as in a user's process running the engine in-process).
    """
    if openmp_loaded():
        return False
    if not any(name in os.environ for name in USER_WAIT_SETTINGS):
        os.environ.update(OPENMP_DEFAULTS)
    return True


def num_threads(processes_on_machine: int = 1) -> tuple[int, str]:
    """The torch thread count for one engine process, and where it comes from (for the log)."""
    value = os.environ.get(ENV_CPU_THREADS, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{ENV_CPU_THREADS} must be a positive integer, got {value!r}")
        return int(value), ENV_CPU_THREADS
    cores, processes = usable_cores(), max(1, processes_on_machine)
    share = f"{cores} cores" if processes == 1 else f"{cores} cores / {processes} engine processes"
    return core_share(processes), f"default: {share}; set {ENV_CPU_THREADS} to change"


def wait_policy() -> str:
    """How this process's OpenMP threads wait, as the environment says (for the log)."""
    settings = [f"{name}={os.environ[name]}" for name in USER_WAIT_SETTINGS if name in os.environ]
    return ", ".join(settings) or "OpenMP defaults (spinning)"
