"""The worker's side of ``LLM.start_profile()`` / ``LLM.stop_profile()`` (vLLM's names).

Between the two calls ``torch.profiler`` records every rank's host operators and, on a GPU, its
kernels. ``stop`` returns what the throughput benchmark reports: the window's wall time, the
device's busy time (the kernels' summed device time; on one stream it does not overlap, so the
rest of the window is time the GPU waited on the host) and its share per kernel family. With
``SPARROW_TORCH_PROFILER_DIR`` set (as vLLM's ``VLLM_TORCH_PROFILER_DIR``) each rank also writes a
Chrome trace there, to open in Perfetto.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import torch

PROFILER_DIR_ENV = "SPARROW_TORCH_PROFILER_DIR"

FAMILIES = [  # (family, regex over kernel names), first match wins
    ("attention", r"attention|attn|flash|paged"),
    ("gemm", r"gemm|matmul|cutlass|sm90|sm80|cublas|_mm|addmm|linear"),
    ("sampling", r"cumsum|scan|searchsorted|softmax|sort|topk|argmax|uniform|rand"),
    ("copies", r"copy|memcpy|memset|fill|cat|index"),
    ("element-wise", r"."),
]


def family(name: str) -> str:
    lowered = name.lower()
    return next(label for label, pattern in FAMILIES if re.search(pattern, lowered))


def device_time_by_family(prof: Any) -> dict[str, float]:
    """Seconds of device (GPU) time per kernel family in a stopped profile; empty on the CPU."""
    seconds: dict[str, float] = {}
    for event in prof.key_averages():
        self_device = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if self_device > 0:
            label = family(event.key)
            seconds[label] = seconds.get(label, 0.0) + self_device / 1e6
    return seconds


class WorkerProfiler:
    """One profiling window of a worker (``start`` then ``stop``)."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self.device = device
        self.rank = rank
        self._prof: Any = None
        self._started = 0.0

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            raise RuntimeError("the profiler is already running: call stop_profile() first")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._synchronize()
        self._prof = profile(activities=activities, record_shapes=False)
        self._prof.start()
        self._started = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        """The window's summary: ``wall_s``, ``device_busy_s`` and ``device_busy_fraction`` (None
        without a GPU), ``device_s_by_family``, ``trace`` (the file written, or None)."""
        if self._prof is None:
            raise RuntimeError("the profiler is not running: call start_profile() first")
        prof, self._prof = self._prof, None
        self._synchronize()
        wall = time.perf_counter() - self._started
        prof.stop()
        by_family = device_time_by_family(prof) if self.device.type == "cuda" else {}
        busy = sum(by_family.values()) if self.device.type == "cuda" else None
        trace = None
        directory = os.environ.get(PROFILER_DIR_ENV)
        if directory:
            os.makedirs(directory, exist_ok=True)
            trace = os.path.join(directory, f"rank{self.rank}-{os.getpid()}-{time.time_ns()}.trace.json")
            prof.export_chrome_trace(trace)
        return {"rank": self.rank, "device": self.device.type, "wall_s": wall, "device_busy_s": busy,
                "device_busy_fraction": None if busy is None or wall <= 0 else busy / wall,
                "device_s_by_family": by_family, "trace": trace}
