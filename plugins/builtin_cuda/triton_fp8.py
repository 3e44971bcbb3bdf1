"""Per-row fp8 (e4m3) quantization of GEMM inputs in one Triton launch, and the fp8 ``linear`` on CUDA.

``quantize_fp8_rows(x)`` returns what ``sparrow.quantization.fp8.quantize_fp8_rows`` (the torch
reference) returns, bit for bit: ``scale[m] = max|x[m, :]| / 448`` (1 for a row of zeros) and
``q[m, k] = float8_e4m3fn(clamp(x[m, k] / scale[m], -448, 448))``, rounded to nearest even. The
reference spends about six launches and as many passes over the row on it (upcast, abs, amax,
divide, clamp, cast); here one program per row reads it once for the maximum and once more
(from registers when the row fits in one block, else from the cache) to scale and round it.

Both divisions are IEEE round-to-nearest (``tl.math.div_rn``), as torch's are. The fp8 rounding is
done by hand on the float32 bits and the code stored as a byte into a uint8 view of the output:

* magnitudes of at least 2**-6 (fp8's normal range) drop 20 of float32's 23 mantissa bits with
  round-to-nearest-even in integer arithmetic (a carry runs into the exponent, as it should);
* smaller ones (fp8's subnormals, multiples of 2**-9) are rounded by a float32 add of 2**14,
  whose unit in the last place is 2**-9; the integer count of 2**-9 steps is then the code
  (8 steps, 2**-6, is also the code of the smallest normal value, so the two ranges meet);
* the sign bit is copied, so ``-0.0`` and negative values that round to zero give ``0x80``,
  as torch's conversion does.

That makes the kernel independent of the GPU's fp8 conversion instructions (it runs on GPUs
without fp8 support too, where ``Fp8Linear`` multiplies the fp8 operands emulated) and of Triton's
CPU interpreter, whose float32 -> float8e4nv cast is not exact (it rounds halves away from zero,
loses the carry of a mantissa that rounds up into the next power of two, e.g. 7.97 -> 4, and
truncates subnormals): the launcher takes CPU tensors, which the interpreter
(``TRITON_INTERPRET=1``) runs, and the same bits come out as on the GPU. Non-finite inputs (inf,
NaN) are outside the contract: the reference's result for them is not reproduced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.quantization.fp8 import FP8, FP8_MAX, Fp8Linear
from sparrow.quantization.fp8 import quantize_fp8_rows as torch_quantize_fp8_rows

MAX_BLOCK = 8192  # a row up to this long is read once, kept in registers between the two passes
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The devices whose tensors quantize_rows gives the kernel (tests add "cpu": the interpreter runs it).
KERNEL_DEVICES: tuple[str, ...] = ("cuda",)


@triton.jit
def _fp8_code(v):
    """float32 ``v`` (finite, |v| <= 448) -> its float8_e4m3fn code, rounded to nearest even, as int32."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: keep 3 of the 23 mantissa bits, round to nearest even, rebias the exponent (127 -> 7).
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: 2**14 + |v| rounds |v| to a multiple of 2**-9; subtract 2**14's bits (141 << 23).
    sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    return tl.where(mag < (121 << 23), sub, normal) | sign


@triton.jit
def _quantize_fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_xk, stride_qm,
                              FP8_MAX_VALUE: tl.constexpr, BLOCK_K: tl.constexpr, ONE_BLOCK: tl.constexpr):
    # grid: (M,). One row per program: its max |x|, then every element scaled, clamped and rounded.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if ONE_BLOCK:
        ok = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        run = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs
            xk = tl.load(x_row + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)
            run = tl.maximum(run, tl.abs(xk))
        amax = tl.max(run, axis=0)
    scale = tl.math.div_rn(amax, FP8_MAX_VALUE)
    scale = tl.where(scale > 0.0, scale, 1.0)
    tl.store(scale_ptr + row, scale)
    if ONE_BLOCK:
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_VALUE), FP8_MAX_VALUE)
        tl.store(q_row + offs, _fp8_code(v).to(tl.uint8), mask=ok)
    else:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs
            ok_k = ks < K
            xk = tl.load(x_row + ks * stride_xk, mask=ok_k, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(tl.math.div_rn(xk, scale), -FP8_MAX_VALUE), FP8_MAX_VALUE)
            tl.store(q_row + ks, _fp8_code(v).to(tl.uint8), mask=ok_k)


def quantize_fp8_rows(x: torch.Tensor, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float32, bfloat16 or float16, any strides) -> ``(q float8_e4m3fn [M, K]
    contiguous, scale float32 [M])``, ``x ~= q * scale``: the torch reference's result in one launch.

    ``block_k`` (a power of two) overrides the block a program walks its row in (tests use it to
    reach the two-pass path at small sizes). A row of length 0 gets scale 1.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_rows takes a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quantize_fp8_rows takes float32, bfloat16 or float16, got {x.dtype}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    if k == 0:
        return q, scale.fill_(1.0)
    if (k - 1) * x.stride(1) >= 2**31:  # the kernel's offsets along a row are int32
        x = x.contiguous()
    block = block_k or min(MAX_BLOCK, triton.next_power_of_2(k))
    _quantize_fp8_rows_kernel[(m,)](
        x, q.view(torch.uint8), scale, k, x.stride(0), x.stride(1), q.stride(0),
        FP8_MAX_VALUE=FP8_MAX, BLOCK_K=block, ONE_BLOCK=k <= block,
        num_warps=4 if block <= 2048 else 8,
    )
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the CUDA fp8 implementations quantize with: the Triton kernel for CUDA tensors (one
    launch), the torch reference for the rest (the same result)."""
    if x.device.type in KERNEL_DEVICES and x.dim() == 2 and x.dtype in SUPPORTED_DTYPES:
        return quantize_fp8_rows(x)
    return torch_quantize_fp8_rows(x)


class TritonFp8Linear(Fp8Linear):
    """:class:`~sparrow.quantization.fp8.Fp8Linear` with its per-token activation quantization
    (and the weights' per-channel one, when a dense checkpoint is bound) in :func:`quantize_fp8_rows`."""

    name = "triton_fp8"

    @staticmethod
    def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows(x)
