"""The CUDA platform's Triton grouped GEMM for fused_moe (sparrow_cuda.triton_moe) against the
layer's torch reference, and its registration for platform "cuda".

As in test_triton_ops.py: on a machine without CUDA where nothing imported triton yet, this module
sets TRITON_INTERPRET=1 and runs the kernels in-process on CPU tensors; otherwise one test re-runs
this file in a subprocess with the variable set, and the ``cuda``-marked tests run the same checks
with the compiled kernels on the GPU. Sizes are small (the interpreter is slow) but odd: 5 or 7
experts, top-1..3, intermediate sizes that are no power of two, experts with no token.
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

from sparrow.layers.fused_moe import FusedMoE, select_experts  # noqa: E402
from sparrow.layers.parallel import ParallelContext  # noqa: E402
from sparrow.ops.moe_cases import fill_experts  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")
compiled = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(),
                              reason="needs an NVIDIA GPU (and triton not interpreting)")
IMPL = "sparrow_cuda.triton_moe:TritonFusedMoE"


@pytest.mark.skipif(INTERPRETING or not HAS_TRITON, reason="already running under the interpreter")
def test_interpreted_kernels_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:  # 5: all skipped
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_registered_for_cuda_only():
    from sparrow.plugins import get_registry
    from sparrow_cuda.ops import sparrow_register_ops

    calls = []
    sparrow_register_ops(register=lambda op, platform, impl, override=False: calls.append((op, platform, impl)))
    assert ("fused_moe", "cuda", IMPL) in calls
    entry = get_registry().ops["fused_moe"]
    assert entry["cuda"] == IMPL and "cpu" not in entry


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_impl_refuses_cpu_layers():
    from sparrow.ops import OpImpl, bind_ops
    from sparrow.plugins import import_object

    impl = import_object(IMPL)
    assert issubclass(impl, OpImpl) and impl.name == "triton"
    layer = FusedMoE(4, 16, 8)
    assert not impl.supports(layer)
    assert {op: dict(c) for op, c in bind_ops(torch.nn.ModuleList([layer]), "cuda").items()} == {
        "fused_moe": {"native": 1}}


# -- the checks, run on CPU tensors by the interpreter and on CUDA tensors by the GPU ----------

def make_layer(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str,
               tp: ParallelContext | None = None) -> FusedMoE:
    layer = FusedMoE(num_experts, hidden, inter, tp=tp)
    fill_experts(layer, torch.Generator().manual_seed(num_experts * 100 + inter))
    return layer.to(device=device, dtype=dtype)


def routed_inputs(rows: int, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, device: str,
                  weights_dtype: torch.dtype | None = None):
    gen = torch.Generator().manual_seed(rows * 7 + top_k)
    x = torch.randn(rows, hidden, generator=gen)
    logits = torch.randn(rows, num_experts, generator=gen)
    logits[:, -1] = -30.0  # the last expert gets no token
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return (x.to(device=device, dtype=dtype), weights.to(device=device, dtype=weights_dtype or dtype),
            ids.to(device))


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 5e-3, "rtol": 5e-3},
            torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}[dtype]


def check_against_reference(device: str, rows: int, num_experts: int, top_k: int, inter: int,
                            dtype: torch.dtype, weights_dtype: torch.dtype | None = None) -> None:
    from sparrow_cuda.triton_moe import TritonFusedMoE

    hidden = 64
    layer = make_layer(num_experts, hidden, inter, dtype, device)
    x, weights, ids = routed_inputs(rows, hidden, num_experts, top_k, dtype, device, weights_dtype)
    expected = layer.forward_native(x, weights, ids)
    got = TritonFusedMoE(layer)(x, weights, ids)
    assert got.shape == expected.shape and got.dtype == dtype and got.device == x.device
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def check_align(device: str) -> None:
    from sparrow_cuda.triton_moe import align_pairs

    ids = torch.tensor([[3, 0], [0, 1], [3, 0], [4, 3]], device=device)  # expert 2 gets nothing
    sorted_pairs, tile_experts = align_pairs(ids, num_experts=5, block_m=4)
    sorted_pairs, tile_experts = sorted_pairs.cpu(), tile_experts.cpu()
    num_pairs = ids.numel()
    assert sorted_pairs.numel() % 4 == 0 and tile_experts.numel() == sorted_pairs.numel() // 4
    flat = ids.reshape(-1).cpu()
    seen = []
    for tile, expert in enumerate(tile_experts.tolist()):
        pairs = [p for p in sorted_pairs[tile * 4:(tile + 1) * 4].tolist() if p < num_pairs]
        if expert < 0:
            assert not pairs, "a tile past the last group holds no pair"
            continue
        assert pairs and all(int(flat[p]) == expert for p in pairs), f"tile {tile} mixes experts"
        seen += pairs
    assert sorted(seen) == list(range(num_pairs)), "every pair appears exactly once"
    assert [e for e in tile_experts.tolist() if e >= 0] == [0, 1, 3, 4]


def check_fp8_against_emulation(device: str, rows: int, top_k: int, dtype: torch.dtype) -> None:
    """The fp8 grouped GEMM against the emulated fp8 product (sparrow.quantization.fp8.Fp8FusedMoE)
    on the same fp8 weights: the same fp8 operands, both accumulated in float32."""
    from sparrow.ops import bind_ops
    from sparrow.quantization.fp8 import Fp8FusedMoE
    from sparrow_cuda.triton_moe import TritonFp8FusedMoE

    emulated, triton_layer = (make_layer(5, 64, 48, dtype, device) for _ in range(2))
    bind_ops(emulated, device, overrides={"fused_moe": Fp8FusedMoE})
    bind_ops(triton_layer, device, overrides={"fused_moe": TritonFp8FusedMoE})
    assert triton_layer.gate_up_proj.dtype == torch.float8_e4m3fn and triton_layer.op_impl.use_triton
    x, weights, ids = routed_inputs(rows, 64, 5, top_k, dtype, device)
    expected = emulated.op_impl(x, weights, ids)
    got = triton_layer.op_impl(x, weights, ids)
    assert got.shape == expected.shape and got.dtype == dtype
    # A gated activation that lands on an fp8 rounding boundary may round the other way in one
    # of the two (their gate/up sums differ in the last bits, float32's or, rounded to the model's
    # dtype between the GEMMs, bfloat16's), moving an output by up to an fp8 step of that term.
    scale = expected.abs().max().item() * (5e-3 if dtype == torch.float32 else 3e-2)
    torch.testing.assert_close(got.float(), expected.float(), atol=scale, rtol=tolerance(dtype)["rtol"])


def check_tensor_parallel_slice(device: str) -> None:
    """Rank 1 of 2 holds half of every expert's intermediate features: the kernel computes the
    same partial sum as the reference on that slice."""
    from sparrow_cuda.triton_moe import TritonFusedMoE

    layer = make_layer(5, 64, 48, torch.float32, device, tp=ParallelContext(1, 2))
    x, weights, ids = routed_inputs(6, 64, 5, 2, torch.float32, device)
    torch.testing.assert_close(TritonFusedMoE(layer)(x, weights, ids), layer.forward_native(x, weights, ids),
                               **tolerance(torch.float32))


CASES = [  # (rows, experts, top_k, intermediate)
    (1, 5, 3, 40),
    (3, 7, 2, 24),
    (17, 5, 1, 40),
    (37, 5, 3, 24),
]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,num_experts,top_k,inter", CASES)
def test_fused_moe(rows, num_experts, top_k, inter, dtype):
    check_against_reference("cpu", rows, num_experts, top_k, inter, dtype)


@interpreted
def test_fused_moe_with_float32_routing_weights_and_a_tp_slice():
    # Mixtral's routing weights stay float32 while the model runs in bfloat16.
    check_against_reference("cpu", 5, 5, 2, 40, torch.bfloat16, weights_dtype=torch.float32)
    check_tensor_parallel_slice("cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_fused_moe(dtype):
    for rows, top_k in ((1, 2), (13, 3)):
        check_fp8_against_emulation("cpu", rows, top_k, dtype)


@interpreted
def test_align_pairs_groups_by_expert():
    check_align("cpu")


@interpreted
def test_conformance_cases():
    from sparrow.ops.check import compare_outputs, op_cases
    from sparrow_cuda.triton_moe import TritonFusedMoE

    for case in op_cases("fused_moe", torch.float32, torch.device("cpu")):
        expected = case.make_layer().forward_native(*case.args)
        ok, detail = compare_outputs(case, expected, TritonFusedMoE(case.make_layer())(*case.args))
        assert ok, f"{case.label}: {detail}"


@interpreted
def test_launcher_refuses_what_it_cannot_read():
    from sparrow_cuda.triton_moe import fused_moe

    layer = make_layer(4, 16, 8, torch.float32, "cpu")
    x, weights, ids = routed_inputs(3, 16, 4, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, layer.gate_up_proj, layer.down_proj, weights[:, :1], ids)
    with pytest.raises(ValueError, match="hidden size"):
        fused_moe(x[:, :8], layer.gate_up_proj, layer.down_proj, weights, ids)
    assert fused_moe(x[:0], layer.gate_up_proj, layer.down_proj, weights[:0], ids[:0]).shape == (0, 16)


# -- the same checks with the compiled kernels ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.cuda
@compiled
def test_gpu_fused_moe(dtype):
    for rows, num_experts, top_k, inter in CASES + [(300, 8, 2, 96)]:
        check_against_reference("cuda", rows, num_experts, top_k, inter, dtype)


@pytest.mark.cuda
@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_fp8_fused_moe(dtype):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    for rows, top_k in ((1, 2), (13, 3), (300, 2)):
        check_fp8_against_emulation("cuda", rows, top_k, dtype)


@pytest.mark.cuda
@compiled
def test_gpu_align_tp_and_binding():
    from sparrow.ops import bind_ops

    check_align("cuda")
    check_tensor_parallel_slice("cuda")
    layer = make_layer(5, 64, 40, torch.bfloat16, "cuda")
    summary = bind_ops(torch.nn.ModuleList([layer]), "cuda")
    assert {op: dict(c) for op, c in summary.items()} == {"fused_moe": {"triton": 1}}
