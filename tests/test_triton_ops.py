"""The CUDA platform's Triton element-wise ops (sparrow_cuda.triton_elementwise) against the
layers' torch references, and their registration for platform "cuda".

Like test_triton_kernels.py: TRITON_INTERPRET=1 must be set before triton is first imported, so on
a machine without CUDA where nothing imported triton yet this module sets it and runs the kernels
in-process on CPU tensors; otherwise one test re-runs this file in a subprocess with the variable
set, and the ``cuda``-marked tests run the same checks with the compiled kernels on the GPU.

The interpreter truncates when it casts float32 to bfloat16 (the GPU rounds to nearest even), so
interpreted bf16 results may sit an ulp or two off the reference; fp32 and fp16 results, and every
dtype on the GPU, are held to the reference's own rounding where the arithmetic is the same.
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

from sparrow.layers.activation import SiluAndMul  # noqa: E402
from sparrow.layers.layernorm import RMSNorm  # noqa: E402
from sparrow.layers.rotary import RotaryEmbedding, default_inv_freq  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")
compiled = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(),
                              reason="needs an NVIDIA GPU (and triton not interpreting)")

OPS = {"rms_norm": "TritonRMSNorm", "silu_and_mul": "TritonSiluAndMul",
       "rotary_embedding": "TritonRotaryEmbedding"}


@pytest.mark.skipif(INTERPRETING or not HAS_TRITON, reason="already running under the interpreter")
def test_interpreted_ops_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:  # 5: all skipped
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


# -- registration ------------------------------------------------------------------------------

def test_ops_registered_for_cuda_only():
    from sparrow.plugins import get_registry
    from sparrow_cuda.ops import sparrow_register_ops

    calls = []
    sparrow_register_ops(register=lambda op, platform, impl, override=False: calls.append((op, platform, impl)))
    assert {platform for _, platform, _ in calls} == {"cuda"}
    assert {op: impl for op, _, impl in calls if op in OPS} == {  # fused_moe: tests/test_triton_moe.py
        op: f"sparrow_cuda.triton_elementwise:{cls}" for op, cls in OPS.items()}
    registry = get_registry()
    for op, cls in OPS.items():
        assert registry.ops[op]["cuda"] == f"sparrow_cuda.triton_elementwise:{cls}"
        assert not str(registry.ops[op].get("cpu", "")).startswith("sparrow_cuda"), op


def test_registering_imports_neither_torch_nor_triton():
    code = ("import sys, sparrow_cuda\n"
            "sparrow_cuda.sparrow_register_ops(register=lambda *a, **k: None)\n"
            "heavy = [m for m in ('torch', 'triton') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_impls_are_op_impls_that_refuse_cpu_layers():
    from sparrow.ops import OpImpl, bind_ops
    from sparrow.plugins import import_object

    impls = {op: import_object(f"sparrow_cuda.triton_elementwise:{cls}") for op, cls in OPS.items()}
    assert all(issubclass(impl, OpImpl) and impl.name == "triton" for impl in impls.values())
    # Layers whose weights live on the CPU keep the torch reference.
    assert not impls["rms_norm"].supports(make_norm(64, torch.float32, "cpu"))
    assert not impls["rotary_embedding"].supports(make_rotary(64, 64, "cpu"))
    model = torch.nn.ModuleDict({"norm": make_norm(64, torch.bfloat16, "cpu"), "rotary": make_rotary(64, 32, "cpu")})
    summary = bind_ops(model, "cuda")
    assert {op: dict(counts) for op, counts in summary.items()} == {"rms_norm": {"native": 1},
                                                                    "rotary_embedding": {"native": 1}}
    assert model["norm"].op_impl is None and model["rotary"].op_impl is None


# -- the checks, run on CPU tensors by the interpreter and on CUDA tensors by the GPU ----------

ROWS = (1, 3, 17)
HIDDEN = (64, 96)  # 96: the block is wider than the row


def make_norm(hidden: int, dtype: torch.dtype, device: str) -> RMSNorm:
    layer = RMSNorm(hidden, 1e-6, params_dtype=dtype)
    gen = torch.Generator().manual_seed(hidden)
    layer.weight.data.copy_((1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype))
    return layer.to(device)


def make_rotary(head_dim: int, rotary_dim: int, device: str) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, rotary_dim, default_inv_freq(rotary_dim, 10000.0), 128).to(device)


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
            torch.float16: {"atol": 5e-3, "rtol": 5e-3},
            torch.bfloat16: {"atol": 5e-2, "rtol": 2e-2}}[dtype]


def exact_rounding(dtype: torch.dtype, device: str) -> bool:
    return device == "cuda" or dtype != torch.bfloat16


def impl_for(layer):
    from sparrow_cuda import triton_elementwise as te

    cls = {RMSNorm: te.TritonRMSNorm, SiluAndMul: te.TritonSiluAndMul,
           RotaryEmbedding: te.TritonRotaryEmbedding}[type(layer)]
    return cls(layer)


def check_rms_norm(device: str, rows: int, hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    layer = make_norm(hidden, dtype, device)
    impl = impl_for(layer)
    x = randn(rows, hidden, dtype=dtype, device=device, seed=1)
    if not with_residual:
        expected = layer.forward_native(x)
        x_before = x.clone()
        out = impl(x)
        assert out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out, expected, **tolerance(dtype))
        assert torch.equal(x, x_before), "rms_norm without a residual must not write its input"
        return
    residual = randn(rows, hidden, dtype=dtype, device=device, seed=2)
    expected_out, expected_residual = layer.forward_native(x, residual)
    out, new_residual = impl(x, residual)
    assert out is x and new_residual is residual, "the fused form works in place on x and residual"
    if exact_rounding(dtype, device):
        assert torch.equal(new_residual, expected_residual)
    else:
        torch.testing.assert_close(new_residual, expected_residual, **tolerance(dtype))
    torch.testing.assert_close(out, expected_out, **tolerance(dtype))


def check_rms_norm_of_heads(device: str, dtype: torch.dtype) -> None:
    # q_norm/k_norm normalise [T, H, D] head views of a fused QKV output (outer strides != D).
    head_dim, num_heads, rows = 64, 3, 5
    layer = make_norm(head_dim, dtype, device)
    qkv = randn(rows, 2 * num_heads, head_dim, dtype=dtype, device=device, seed=3)
    q = qkv[:, :num_heads]
    assert not q.is_contiguous()
    torch.testing.assert_close(impl_for(layer)(q), layer.forward_native(q), **tolerance(dtype))


def check_silu_and_mul(device: str, rows: int, hidden: int, dtype: torch.dtype) -> None:
    layer = SiluAndMul()
    x = randn(rows, 2 * hidden, dtype=dtype, device=device, seed=4)
    expected = layer.forward_native(x)
    out = impl_for(layer)(x)
    assert out.shape == (rows, hidden)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def check_rotary(device: str, rows: int, head_dim: int, rotary_dim: int, dtype: torch.dtype) -> None:
    num_q_heads, num_kv_heads = 4, 2
    layer = make_rotary(head_dim, rotary_dim, device)
    # query and key as the model passes them: views into one fused QKV output.
    qkv = randn(rows, num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device, seed=5)
    query, key = qkv[:, :num_q_heads], qkv[:, num_q_heads:num_q_heads + num_kv_heads]
    value_before = qkv[:, num_q_heads + num_kv_heads:].clone()
    gen = torch.Generator().manual_seed(rows)
    positions = torch.randint(0, 128, (rows,), generator=gen).to(device)
    expected_q, expected_k = layer.forward_native(positions, query, key)
    out_q, out_k = impl_for(layer)(positions, query, key)
    assert out_q is query and out_k is key, "rotary works in place on query and key"
    if dtype != torch.float32 and exact_rounding(dtype, device):
        # Rounded as the reference rounds (see the kernel); float32 may contract to FMAs.
        assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    torch.testing.assert_close(out_q, expected_q, **tolerance(dtype))
    torch.testing.assert_close(out_k, expected_k, **tolerance(dtype))
    if rotary_dim < head_dim:  # the tail of each head passes through bit for bit
        assert torch.equal(out_q[..., rotary_dim:], expected_q[..., rotary_dim:])
    assert torch.equal(qkv[:, num_q_heads + num_kv_heads:], value_before), "value must be untouched"


def check_fallbacks(device: str) -> None:
    """Layouts the kernels do not take go to forward_native, leaving the inputs untouched."""
    dtype = torch.float32
    norm = make_norm(64, dtype, device)
    x = randn(3, 64, dtype=dtype, device=device, seed=6)
    residual = randn(64, 3, dtype=dtype, device=device, seed=7).t()  # non-contiguous
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = impl_for(norm)(x, residual)
    expected_out, expected_residual = norm.forward_native(x_before, residual_before)
    assert torch.equal(out, expected_out) and torch.equal(new_residual, expected_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    # A weight dtype that differs from the input's: the reference's type promotion decides.
    x16 = x.to(torch.bfloat16)
    assert impl_for(norm)(x16).dtype == norm.forward_native(x16).dtype

    gate_up = randn(4, 3, dtype=dtype, device=device, seed=8).t()  # [3, 4], non-contiguous
    torch.testing.assert_close(impl_for(SiluAndMul())(gate_up), SiluAndMul().forward_native(gate_up))

    rotary = make_rotary(64, 64, device)
    query = randn(3, 64, 2, dtype=dtype, device=device, seed=9).transpose(1, 2)  # inner stride 2
    key = randn(3, 1, 64, dtype=dtype, device=device, seed=10)
    positions = torch.tensor([5, 0, 9], device=device)
    query_before = query.clone()
    out_q, out_k = impl_for(rotary)(positions, query, key)
    assert out_q is not query and torch.equal(query, query_before)
    expected_q, expected_k = rotary.forward_native(positions, query, key)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)


@interpreted
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm(rows, hidden, dtype, with_residual):
    check_rms_norm("cpu", rows, hidden, dtype, with_residual)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_strided_heads(dtype):
    check_rms_norm_of_heads("cpu", dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(rows, hidden, dtype):
    check_silu_and_mul("cpu", rows, hidden, dtype)


ROTARY_SHAPES = [(64, 64), (96, 96), (64, 32), (96, 48)]  # (head_dim, rotary_dim): full and partial


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,rotary_dim", ROTARY_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary(rows, head_dim, rotary_dim, dtype):
    check_rotary("cpu", rows, head_dim, rotary_dim, dtype)


@interpreted
def test_unsupported_layouts_fall_back_to_the_reference():
    check_fallbacks("cpu")


@interpreted
def test_launchers_refuse_layouts_they_cannot_read():
    from sparrow_cuda.triton_elementwise import fused_add_rms_norm, rms_norm, rotary_neox, silu_and_mul

    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="unit inner stride"):
        rms_norm(torch.randn(8, 3).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        fused_add_rms_norm(x, torch.randn(8, 3).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_neox(torch.zeros(3, dtype=torch.int64), torch.randn(3, 2, 8), torch.randn(3, 1, 8),
                    torch.randn(16, 6), 5)
    # Zero rows launch nothing.
    assert rms_norm(torch.randn(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    assert silu_and_mul(torch.randn(0, 8)).shape == (0, 4)


# -- the same checks with the compiled kernels ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.cuda
@compiled
def test_gpu_rms_norm(rows, hidden, dtype, with_residual):
    check_rms_norm("cuda", rows, hidden, dtype, with_residual)
    check_rms_norm_of_heads("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.cuda
@compiled
def test_gpu_silu_and_rotary(rows, dtype):
    for hidden in HIDDEN:
        check_silu_and_mul("cuda", rows, hidden, dtype)
    for head_dim, rotary_dim in ROTARY_SHAPES:
        check_rotary("cuda", rows, head_dim, rotary_dim, dtype)


@pytest.mark.cuda
@compiled
def test_gpu_fallbacks_and_binding():
    from sparrow.ops import bind_ops

    check_fallbacks("cuda")
    model = torch.nn.ModuleDict({"norm": make_norm(64, torch.bfloat16, "cuda"), "act": SiluAndMul(),
                                 "rotary": make_rotary(64, 32, "cuda")})
    summary = bind_ops(model, "cuda")
    assert {op: dict(counts) for op, counts in summary.items()} == {
        op: {"triton": 1} for op in ("rms_norm", "silu_and_mul", "rotary_embedding")}
    x = randn(5, 64, dtype=torch.bfloat16, device="cuda", seed=11)
    torch.testing.assert_close(model["norm"](x), model["norm"].forward_native(x), **tolerance(torch.bfloat16))

