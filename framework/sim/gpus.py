"""The accelerators the simulated device can stand for: memory, bandwidth and FLOP/s.

Figures are the vendors' data-sheet peaks for the SXM (or, for the L40S, PCIe) part; dense
tensor-core FLOP/s, never the "with sparsity" figure. ``memory_bytes`` is what the CUDA driver
reports as total memory (``torch.cuda.mem_get_info``; vLLM logs it as ``total_gpu_memory``), which
is a little under the marketing size: that is what ``gpu_memory_utilization`` is a share of.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    description: str
    memory_bytes: int  # total device memory as the driver reports it
    bandwidth_bytes_s: float  # peak HBM / GDDR bandwidth
    flops: float  # peak dense bf16 tensor-core FLOP/s


GPUS: dict[str, GpuSpec] = {
    spec.name: spec for spec in (
        # NVIDIA H100 Tensor Core GPU data sheet (H100 SXM): 80 GB HBM3 at 3.35 TB/s, BF16 989.4 TFLOPS
        # dense (1,979 with sparsity). The driver reports 79.19 GiB (vLLM's start-up log on an H100 80GB).
        GpuSpec("h100", "NVIDIA H100 SXM 80GB", round(79.19 * GiB), 3.35e12, 989.4e12),
        # NVIDIA H200 Tensor Core GPU data sheet (H200 SXM): 141 GB HBM3e at 4.8 TB/s, BF16 989.4 TFLOPS
        # dense (the H100's compute). The driver reports about 139.8 GiB.
        GpuSpec("h200", "NVIDIA H200 SXM 141GB", round(139.81 * GiB), 4.8e12, 989.4e12),
        # NVIDIA A100 Tensor Core GPU data sheet (A100 80GB SXM): HBM2e at 2,039 GB/s, BF16 312 TFLOPS
        # dense (624 with sparsity). The driver reports about 79.15 GiB.
        GpuSpec("a100", "NVIDIA A100 SXM 80GB", round(79.15 * GiB), 2.039e12, 312e12),
        # NVIDIA L40S data sheet: 48 GB GDDR6 at 864 GB/s, BF16 362.05 TFLOPS dense (733 with
        # sparsity). The driver reports about 44.4 GiB (ECC on).
        GpuSpec("l40s", "NVIDIA L40S 48GB", round(44.39 * GiB), 864e9, 362.05e12),
    )
}


def get_gpu(name: str) -> GpuSpec:
    """The card named ``name`` (case-insensitive); ValueError listing the known cards."""
    spec = GPUS.get(name.lower()) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown simulated GPU {name!r}; known: {', '.join(GPUS)}")
    return spec
