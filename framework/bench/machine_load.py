"""What else the machine did while a benchmark ran, so that a slow run can be told from a busy machine.

On a shared VM the same run can take 30 % longer because another process or the hypervisor took
CPU time. ``LoadMeter`` reads Linux's ``/proc/stat`` (CPU time of the whole machine, and time the
hypervisor stole) and ``/proc/<pid>/stat`` of this process and its descendants (the engine core,
tensor-parallel ranks), before and after a run:

    others_cores  cores' worth of CPU time used by processes outside the benchmark, on average
    steal_cores   cores' worth of time the hypervisor gave to other machines

Both are 0.0 on a quiet machine. Elsewhere than Linux the meter reports nothing (None).

Neither sees the host below the VM (CPU frequency, caches shared with other guests), so
``probe_speed`` times a fixed matmul of the model's shape right after each run: if the machine's
own speed moves with the run times, the host moved, not the engine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_ticks() -> tuple[int, int] | None:
    """(busy ticks, steal ticks) of all CPUs since boot; busy excludes idle, iowait and steal."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _tree_ticks(root: int) -> int:
    """CPU ticks (user + system, and of reaped children) of ``root`` and its live descendants."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        # fields[0] is the state (field 3); utime, stime, cutime, cstime are fields 14-17.
        ticks[pid] = sum(int(value) for value in fields[11:15])
    total = 0
    for pid, tick in ticks.items():
        ancestor = pid
        while ancestor not in (0, 1) and ancestor != root:
            ancestor = parents.get(ancestor, 0)
        if ancestor == root:
            total += tick
    return total


class LoadMeter:
    """``start()`` before a run, ``stop()`` after it: the other processes' and the hypervisor's share."""

    def __init__(self) -> None:
        self._start: tuple[float, tuple[int, int] | None, int] | None = None

    def start(self) -> None:
        self._start = (time.perf_counter(), _machine_ticks(), _tree_ticks(os.getpid()))

    def stop(self) -> dict[str, float] | None:
        if self._start is None:
            raise RuntimeError("LoadMeter.stop() before start()")
        started, machine_before, ours_before = self._start
        machine_after, ours_after = _machine_ticks(), _tree_ticks(os.getpid())
        elapsed = time.perf_counter() - started
        if machine_before is None or machine_after is None or elapsed <= 0:
            return None
        busy = machine_after[0] - machine_before[0]
        steal = machine_after[1] - machine_before[1]
        # Our processes that exited during the run count as reaped children (cutime/cstime) of ours.
        others = max(0, busy - (ours_after - ours_before))
        return {"others_cores": others / _CLOCK_TICKS / elapsed, "steal_cores": steal / _CLOCK_TICKS / elapsed}


def probe_speed(seconds: float = 0.5) -> float:
    """Sustained FLOP/s of a fixed fp32 linear ([64, 512] x [512, 1536], the tiny model's MLP
    shape) with this process's torch threads, over ``seconds``: the machine's speed at this
    moment, to put beside a run's time. Total work over total time, not a best case."""
    import torch

    x, w = torch.randn(64, 512), torch.randn(1536, 512)
    flops_per_call = 2 * 64 * 512 * 1536
    torch.nn.functional.linear(x, w)
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(20):
            torch.nn.functional.linear(x, w)
        calls += 20
    return calls * flops_per_call / elapsed
