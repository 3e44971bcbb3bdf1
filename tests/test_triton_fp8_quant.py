"""The one-launch Triton per-row fp8 quantization (sparrow_cuda.triton_fp8) against the torch
reference (sparrow.quantization.fp8.quantize_fp8_rows), bit for bit, and its use by the CUDA fp8
``linear`` and ``fused_moe`` implementations.

As in test_triton_moe.py: on a machine without CUDA where nothing imported triton yet, this module
sets TRITON_INTERPRET=1 and runs the kernel in-process on CPU tensors; otherwise one test re-runs
this file in a subprocess with the variable set, and the ``cuda``-marked tests run the same checks
with the compiled kernel on the GPU. The kernel rounds to fp8 by hand on the float32 bits (the
interpreter's own float32 -> float8e4nv cast is not exact, see the module's docstring), so the
interpreted run compares the real codes, not an approximation of them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = HAS_TRITON and (os.environ.get("TRITON_INTERPRET") == "1" or (
    "triton" not in sys.modules and not torch.cuda.is_available()))
if INTERPRETING:
    os.environ["TRITON_INTERPRET"] = "1"

from sparrow.layers.linear import RowParallelLinear  # noqa: E402
from sparrow.quantization.fp8 import FP8, Fp8FusedMoE, Fp8Linear, Fp8Method, quantize_fp8_rows  # noqa: E402
from tests.test_triton_moe import make_layer, routed_inputs  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")
compiled = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(),
                              reason="needs an NVIDIA GPU (and triton not interpreting)")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.skipif(INTERPRETING or not HAS_TRITON, reason="already running under the interpreter")
def test_interpreted_kernel_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:  # 5: all skipped
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_cuda_linear_is_the_triton_one():
    """What the engine binds for ``quantization="fp8"`` on CUDA (the CPU has no built-in fp8)."""
    assert Fp8Method.implementations["cuda"]["linear"] == "sparrow_cuda.triton_fp8:TritonFp8Linear"
    assert "cpu" not in Fp8Method.implementations


# -- the checks, run on CPU tensors by the interpreter and on CUDA tensors by the GPU ---------------

def assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, label: str = "") -> None:
    q, scale = got
    ref_q, ref_scale = quantize_fp8_rows(x)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous() and q.device == x.device, label
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0],) and scale.device == x.device, label
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32)), \
        f"{label}: scales differ in rows {(scale != ref_scale).nonzero().flatten().tolist()[:8]}"
    diff = (q.view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()
    if diff.numel():
        r, c = diff[0].tolist()
        raise AssertionError(f"{label}: {diff.shape[0]} fp8 codes differ, first at [{r}, {c}]: x={x[r, c].item()!r} "
                             f"scale={ref_scale[r].item()!r} got 0x{q.view(torch.uint8)[r, c].item():02x} "
                             f"want 0x{ref_q.view(torch.uint8)[r, c].item():02x}")


def varied_rows(rows: int, cols: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Random rows of magnitudes from 1e-6 to 1e4, an all-zero row, a row of -0.0, a row with one
    huge outlier (within float16's range), a constant row and one of tiny values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 4, rows).unsqueeze(1)
    if rows >= 5:
        x[0] = 0.0
        x[1] = -0.0
        x[2, cols // 3] = -5e4
        x[3] = 3.0
        x[4] = torch.randn(cols, generator=gen) * 1e-5
    return x.to(device=device, dtype=dtype)


def check_varied(device: str, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...],
                 block_ks: tuple[int | None, ...]) -> None:
    from sparrow_cuda.triton_fp8 import quantize_fp8_rows as triton_quantize

    for rows, cols in shapes:
        x = varied_rows(rows, cols, dtype, device, seed=rows * 1000 + cols)
        for block_k in block_ks:
            label = f"{dtype} [{rows}, {cols}] block_k={block_k}"
            assert_same_bits(triton_quantize(x, block_k=block_k), x, label)
        # Strided: a column slice of a wider tensor (row stride > K), and a transposed one (K stride > 1).
        wide = varied_rows(rows, cols + 13, dtype, device, seed=rows + cols)
        assert_same_bits(triton_quantize(wide[:, 5:5 + cols]), wide[:, 5:5 + cols], label + " sliced")
        tall = varied_rows(cols, rows, dtype, device, seed=rows - cols).t()
        assert_same_bits(triton_quantize(tall, block_k=block_ks[-1]), tall, label + " transposed")


def rounding_cases(device: str) -> torch.Tensor:
    """Rows holding 448 (so that the scale is exactly 1 and the row's values are rounded as they
    are) and every fp8 value, every midpoint between neighbours (ties to even), one float32 step
    either side of each midpoint, values under half the smallest subnormal, both signs."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # every finite value >= 0
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(0.0))
    tiny = torch.tensor([2.0 ** -10, 2.0 ** -11, 1e-30, 1e-40, 2.0 ** -10 * 0.999, 2.0 ** -10 * 1.001])
    values = torch.cat([codes, mids, up, down, tiny])
    row = torch.cat([torch.tensor([448.0]), values, -values])
    gen = torch.Generator().manual_seed(3)
    shuffled = row[torch.randperm(row.numel(), generator=gen)]
    return torch.stack([row, shuffled, -row]).to(device)


def random_bit_rows(device: str, rows: int = 8, cols: int = 4096) -> torch.Tensor:
    """float32 values of uniformly random bit patterns up to 448 (every exponent, subnormals
    included), random signs, 448 first in each row (scale 1)."""
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(0, int(torch.tensor(448.0).view(torch.int32)) + 1, (rows, cols), generator=gen,
                         dtype=torch.int32)
    x = bits.view(torch.float32) * torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
    x[:, 0] = 448.0
    return x.to(device)


def check_rounding(device: str) -> None:
    from sparrow_cuda.triton_fp8 import quantize_fp8_rows as triton_quantize

    x = rounding_cases(device)
    assert_same_bits(triton_quantize(x), x, "fp8 grid, midpoints and neighbours")
    assert_same_bits(triton_quantize(x, block_k=128), x, "fp8 grid, two passes")
    assert torch.equal(triton_quantize(x)[1], torch.ones(3, device=device))
    x = random_bit_rows(device)
    assert_same_bits(triton_quantize(x), x, "random float32 bit patterns")
    # Scaled versions of the same: every code reached through a division by a scale that is not 1
    # (1e-39: a scale below float32's normal range, 448e-39 / 448).
    for factor in (3.0, 1e-3, 7e5, 1e-39):
        assert_same_bits(triton_quantize(x * factor), x * factor, f"random bit patterns x {factor}")


def check_empty(device: str) -> None:
    from sparrow_cuda.triton_fp8 import quantize_fp8_rows as triton_quantize

    for dtype in DTYPES:
        q, scale = triton_quantize(torch.empty(0, 64, dtype=dtype, device=device))
        assert q.shape == (0, 64) and q.dtype == FP8 and scale.shape == (0,) and scale.dtype == torch.float32
    q, scale = triton_quantize(torch.empty(3, 0, device=device))
    assert q.shape == (3, 0) and torch.equal(scale, torch.ones(3, device=device))


class Counting:
    """Stands in for ``sparrow_cuda.triton_fp8.quantize_fp8_rows`` (the launcher) and counts its calls."""

    def __init__(self, launcher) -> None:
        self.launcher = launcher
        self.calls = 0

    def __call__(self, x: torch.Tensor, block_k: int | None = None):
        self.calls += 1
        return self.launcher(x, block_k)


def check_linear_uses_kernel(device: str, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """TritonFp8Linear quantizes (weights when bound, activations per call) through the kernel and
    gives Fp8Linear's output exactly: the same fp8 operands into the same GEMM."""
    from sparrow.ops import bind_ops
    from sparrow_cuda import triton_fp8

    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen)
    layers = []
    counter = Counting(triton_fp8.quantize_fp8_rows)
    monkeypatch.setattr(triton_fp8, "quantize_fp8_rows", counter)
    for impl in (Fp8Linear, triton_fp8.TritonFp8Linear):
        layer = RowParallelLinear(96, 48, bias=True)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        layer = layer.to(device=device, dtype=dtype)
        assert bind_ops(layer, device, overrides={"linear": impl}) == {"linear": {impl.name: 1}}
        layers.append(layer)
    reference, triton_layer = layers
    assert counter.calls == 1  # the dense weight, quantized per output channel when bound
    assert torch.equal(triton_layer.weight.view(torch.uint8), reference.weight.view(torch.uint8))
    assert torch.equal(triton_layer.weight_scale, reference.weight_scale)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 96, generator=gen).to(device=device, dtype=dtype)
        before = counter.calls
        got = triton_layer(x.view(rows, 1, 96))
        assert counter.calls == before + 1
        assert torch.equal(got, reference(x.view(rows, 1, 96))), f"{dtype} rows={rows}"
    assert triton_layer(x[:0]).shape == (0, 48)


def check_moe_uses_kernel(device: str, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """TritonFp8FusedMoE quantizes both GEMMs' inputs (and the experts when bound) through the
    kernel; its output equals the one with the torch reference quantizing them."""
    from sparrow.ops import bind_ops
    from sparrow_cuda import triton_fp8
    from sparrow_cuda.triton_moe import TritonFp8FusedMoE

    counter = Counting(triton_fp8.quantize_fp8_rows)
    monkeypatch.setattr(triton_fp8, "quantize_fp8_rows", counter)
    layer, reference_layer = (make_layer(5, 64, 48, dtype, device) for _ in range(2))
    bind_ops(layer, device, overrides={"fused_moe": TritonFp8FusedMoE})
    assert counter.calls == 2 and layer.op_impl.use_triton  # gate_up_proj and down_proj, once each
    bind_ops(reference_layer, device, overrides={"fused_moe": Fp8FusedMoE})
    for name in ("gate_up_proj", "down_proj", "gate_up_scale", "down_scale"):
        got, want = getattr(layer, name), getattr(reference_layer, name)
        assert torch.equal(got.view(torch.uint8) if got.dtype == FP8 else got,
                           want.view(torch.uint8) if want.dtype == FP8 else want), name
    x, weights, ids = routed_inputs(9, 64, 5, 2, dtype, device)
    before = counter.calls
    got = layer.op_impl(x, weights, ids)
    assert counter.calls == before + 2  # the gate/up input per token, the down input per pair
    monkeypatch.setattr(triton_fp8, "KERNEL_DEVICES", ())  # everything through the torch reference
    assert torch.equal(got, layer.op_impl(x, weights, ids))
    assert counter.calls == before + 2


# -- interpreted on CPU tensors --------------------------------------------------------------------

@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_bit_for_bit(dtype):
    check_varied("cpu", dtype, shapes=((7, 40), (9, 256), (1, 1), (12, 300)), block_ks=(None, 64))


@interpreted
def test_rounding_to_nearest_even_everywhere():
    check_rounding("cpu")


@interpreted
def test_empty_inputs_and_refusals():
    from sparrow_cuda.triton_fp8 import quantize_fp8_rows as triton_quantize

    check_empty("cpu")
    with pytest.raises(ValueError, match="2-D"):
        triton_quantize(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_quantize(torch.ones(2, 3, dtype=torch.float64))


@interpreted
def test_quantize_rows_keeps_the_torch_reference_off_cuda(monkeypatch):
    from sparrow_cuda import triton_fp8

    counter = Counting(triton_fp8.quantize_fp8_rows)
    monkeypatch.setattr(triton_fp8, "quantize_fp8_rows", counter)
    x = varied_rows(6, 32, torch.bfloat16, "cpu")
    assert_same_bits(triton_fp8.quantize_rows(x), x)
    assert counter.calls == 0
    monkeypatch.setattr(triton_fp8, "KERNEL_DEVICES", ("cpu",))
    assert_same_bits(triton_fp8.quantize_rows(x), x)
    assert counter.calls == 1
    x64 = x.double()  # a dtype the kernel does not read: the reference's business
    assert_same_bits(triton_fp8.quantize_rows(x64), x64)
    assert counter.calls == 1


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_uses_the_kernel(monkeypatch, dtype):
    from sparrow_cuda import triton_fp8

    monkeypatch.setattr(triton_fp8, "KERNEL_DEVICES", ("cpu",))  # as CUDA tensors would
    check_linear_uses_kernel("cpu", monkeypatch, dtype)


@interpreted
def test_fused_moe_uses_the_kernel(monkeypatch):
    from sparrow_cuda import triton_fp8

    monkeypatch.setattr(triton_fp8, "KERNEL_DEVICES", ("cpu",))
    check_moe_uses_kernel("cpu", monkeypatch, torch.float32)


# -- the same checks with the compiled kernel ------------------------------------------------------

@pytest.mark.cuda
@compiled
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_reference_bit_for_bit(dtype):
    check_varied("cuda", dtype, shapes=((7, 40), (12, 300), (300, 4096), (64, 14336), (5, 20000)),
                 block_ks=(None, 256))


@pytest.mark.cuda
@compiled
def test_gpu_rounding_and_empty_inputs():
    check_rounding("cuda")
    check_empty("cuda")


@pytest.mark.cuda
@compiled
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_linear_and_fused_moe_use_the_kernel(monkeypatch, dtype):
    check_linear_uses_kernel("cuda", monkeypatch, dtype)
    if torch.cuda.get_device_capability() >= (8, 9):  # the Triton fp8 grouped GEMM
        check_moe_uses_kernel("cuda", monkeypatch, dtype)
