"""The CUDA platform's Triton GEMM for AWQ / GPTQ weights (sparrow_cuda.triton_quant) against the
layers' torch reference (the weights dequantized in float32), and its place in the int4 methods.

Like test_triton_ops.py: TRITON_INTERPRET=1 must be set before triton is first imported, so on a
machine without CUDA where nothing imported triton yet this module sets it and runs the kernel
in-process on CPU tensors at small sizes; otherwise one test re-runs this file in a subprocess with
the variable set, and the ``cuda``-marked tests run the same checks compiled on the GPU.
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

from sparrow.layers.linear import MergedColumnParallelLinear, RowParallelLinear  # noqa: E402
from sparrow.layers.parallel import ParallelContext  # noqa: E402
from sparrow.quantization import quantization_scope  # noqa: E402
from sparrow.quantization.int4 import AwqMethod, GptqMethod  # noqa: E402
from sparrow.tiny import quant_ckpt  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")
compiled = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(),
                              reason="needs an NVIDIA GPU (and triton not interpreting)")


@pytest.mark.skipif(INTERPRETING or not HAS_TRITON, reason="already running under the interpreter")
def test_interpreted_kernel_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:  # 5: all skipped
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_int4_methods_serve_linear_with_triton_on_cuda():
    for method in (AwqMethod, GptqMethod):
        assert method.implementations["cuda"]["linear"] == "sparrow_cuda.triton_quant:TritonInt4Linear"
        assert method.implementations["cpu"]["linear"] == "sparrow.quantization.dequant:DequantizedLinear"
        # mixture-of-experts layers: tests/test_triton_moe_int4.py, tests/test_quantization_moe_int4.py


# -- the checks: layers loaded from the published layouts, the kernel against the reference ------
CASES = {
    "awq g32": ("awq", dict(group_size=32)),
    "gptq asym g16": ("gptq", dict(group_size=16, bits=4, sym=False)),
    "gptq act-order rank 1/2": ("gptq", dict(group_size=16, bits=4, sym=True, desc_act=True, rank=1)),
    "gptq 8-bit g-1": ("gptq", dict(group_size=-1, bits=8, sym=True)),
}


def make_layers(case: str, dtype: torch.dtype, device: str):
    """A gate/up layer (two shards) and a row-parallel layer loaded from a checkpoint of ``case``."""
    method, options = CASES[case]
    rank = options.get("rank", 0)
    world = 2 if "rank" in options else 1
    config = quant_ckpt._quant_config(method, options["group_size"], options.get("bits", 4),
                                      options.get("sym", False), options.get("desc_act", False), "dynamic")
    quant = (AwqMethod if method == "awq" else GptqMethod)(config)
    gen = torch.Generator().manual_seed(11)
    gate, up, down = torch.randn(64, 96, generator=gen), torch.randn(64, 96, generator=gen), \
        torch.randn(96, 128, generator=gen)
    tp = ParallelContext(rank, world, communicator=object())
    with quantization_scope(quant):
        gate_up = MergedColumnParallelLinear(96, [64, 64], bias=True, tp=tp, params_dtype=dtype)
        row = RowParallelLinear(128, 96, tp=tp, params_dtype=dtype)

    def tensors(weight, key):
        if method == "awq":
            return quant_ckpt.awq_tensors(weight, options["group_size"])[0]
        perm = quant_ckpt.act_order_permutation(key, weight.shape[1]) if options.get("desc_act") else None
        return quant_ckpt.gptq_tensors(weight, options["group_size"], options["bits"], options["sym"], perm)[0]

    for shard, weight in enumerate((gate, up)):
        for name, tensor in tensors(weight, "mlp_in").items():
            getattr(gate_up, name).weight_loader(getattr(gate_up, name), tensor, shard)
    gate_up.bias.weight_loader(gate_up.bias, torch.randn(128, generator=gen))
    for name, tensor in tensors(down, "down").items():
        getattr(row, name).weight_loader(getattr(row, name), tensor)
    return gate_up.to(device), row.to(device)


def check_case(case: str, rows: int, dtype: torch.dtype, device: str) -> None:
    from sparrow_cuda.triton_quant import TritonInt4Linear

    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype]
    for layer in make_layers(case, dtype, device):
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, layer.input_size_per_rank, generator=gen).to(dtype).to(device)
        bias = layer.bias
        # The reference: the checkpoint dequantized in float32 (the layer's forward_native).
        expected = layer.forward_native(x.float(), None if bias is None else bias.float())
        assert TritonInt4Linear.supports(layer)
        impl = TritonInt4Linear(layer)
        impl.process_weights()
        assert layer.qweight.shape == (layer.input_size_per_rank * impl.bits // 32, layer.output_size_per_rank)
        got = impl(x, bias)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@interpreted
@pytest.mark.parametrize("case", list(CASES))
def test_int4_gemm_interpreted(case):
    for rows in (1, 19):
        check_case(case, rows, torch.float32, "cpu")


@interpreted
def test_int4_gemm_interpreted_empty_and_half():
    from sparrow_cuda.triton_quant import TritonInt4Linear

    gate_up, _ = make_layers("awq g32", torch.float16, "cpu")
    impl = TritonInt4Linear(gate_up)
    impl.process_weights()
    assert impl(torch.zeros(0, 96, dtype=torch.float16)).shape == (0, 128)
    check_case("gptq asym g16", 5, torch.float16, "cpu")


@compiled
@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_gemm_on_gpu(case, dtype):
    for rows in (1, 19, 300):
        check_case(case, rows, dtype, "cuda")
