"""The CUDA platform's grouped GEMM for AWQ / GPTQ experts (sparrow_cuda.triton_moe_int4) against an
independent float32 reference: every expert's checkpoint tensors dequantized by the layers'
``operands`` and the mixture computed pair by pair.

As in test_triton_quant.py: on a machine without CUDA where nothing imported triton yet, this module
sets TRITON_INTERPRET=1 and runs the kernel in-process on CPU tensors at small, odd sizes (5 experts,
top-1..3, experts with no token, TP rank 1 of 2, act order, 8 bits); otherwise one test re-runs this
file in a subprocess with the variable set, and the ``cuda``-marked tests run the same checks compiled.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = HAS_TRITON and (os.environ.get("TRITON_INTERPRET") == "1" or (
    "triton" not in sys.modules and not torch.cuda.is_available()))
if INTERPRETING:
    os.environ["TRITON_INTERPRET"] = "1"

from sparrow.layers.fused_moe import FusedMoE, select_experts  # noqa: E402
from sparrow.layers.parallel import ParallelContext  # noqa: E402
from sparrow.quantization import quantization_scope  # noqa: E402
from sparrow.quantization.int4 import AwqMethod, GptqMethod  # noqa: E402
from sparrow.tiny import quant_ckpt  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")
compiled = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(),
                              reason="needs an NVIDIA GPU (and triton not interpreting)")
IMPL = "sparrow_cuda.triton_moe_int4:TritonInt4FusedMoE"
HIDDEN, INTER, EXPERTS = 64, 96, 5


@pytest.mark.skipif(INTERPRETING or not HAS_TRITON, reason="already running under the interpreter")
def test_interpreted_kernel_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:  # 5: all skipped
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_int4_methods_serve_experts_packed_on_cuda():
    for method in (AwqMethod, GptqMethod):
        assert method.implementations["cuda"]["fused_moe"] == IMPL
        assert method.implementations["cpu"]["fused_moe"] == "sparrow.quantization.dequant:DequantizedFusedMoE"


CASES = {
    "awq g16": ("awq", dict(group_size=16)),
    "gptq asym g16": ("gptq", dict(group_size=16, bits=4, sym=False)),
    "gptq act-order rank 1/2": ("gptq", dict(group_size=32, bits=4, sym=True, desc_act=True, rank=1)),
    "gptq 8-bit g-1": ("gptq", dict(group_size=-1, bits=8, sym=True)),
}


def make_layer(case: str, dtype: torch.dtype) -> FusedMoE:
    """A FusedMoE whose experts load a checkpoint quantized as ``case`` (the model loader's path:
    each expert's gate/up shards and down layer through their weight loaders)."""
    method, options = CASES[case]
    rank = options.get("rank", 0)
    world = 2 if "rank" in options else 1
    config = quant_ckpt._quant_config(method, options["group_size"], options.get("bits", 4),
                                      options.get("sym", False), options.get("desc_act", False), "dynamic")
    quant = (AwqMethod if method == "awq" else GptqMethod)(config)
    tp = ParallelContext(rank, world, communicator=object())
    with quantization_scope(quant):
        layer = FusedMoE(EXPERTS, HIDDEN, INTER, tp=tp, params_dtype=dtype)
    assert layer.quantized
    gen = torch.Generator().manual_seed(7)

    def tensors(weight, key):
        if method == "awq":
            return quant_ckpt.awq_tensors(weight, options["group_size"])[0]
        perm = quant_ckpt.act_order_permutation(key, weight.shape[1]) if options.get("desc_act") else None
        return quant_ckpt.gptq_tensors(weight, options["group_size"], options["bits"], options["sym"], perm)[0]

    for expert in range(EXPERTS):
        gate_up, down = layer.get_submodule(f"{expert}.gate_up_proj"), layer.get_submodule(f"{expert}.down_proj")
        for shard in range(2):
            weight = torch.randn(INTER, HIDDEN, generator=gen) * 0.2
            for name, tensor in tensors(weight, f"e{expert}.{shard}").items():
                getattr(gate_up, name).weight_loader(getattr(gate_up, name), tensor, shard)
        for name, tensor in tensors(torch.randn(HIDDEN, INTER, generator=gen) * 0.2, f"e{expert}.down").items():
            getattr(down, name).weight_loader(getattr(down, name), tensor)
    return layer


def reference(layer: FusedMoE, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32, one (token, expert) pair at a time, from each expert's dequantized operands."""
    def dense(linear):  # [K, N] float32
        q, zeros, scales, group_of = linear.weights.operands(linear)
        return (q.float() - zeros.float()[group_of]) * scales.float()[group_of]

    experts = [(dense(layer.get_submodule(f"{e}.gate_up_proj")), dense(layer.get_submodule(f"{e}.down_proj")))
               for e in range(layer.num_experts)]
    inter = layer.intermediate_size_per_rank
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for token in range(hidden.shape[0]):
        x = hidden[token].float()
        for slot in range(ids.shape[1]):
            w13, w2 = experts[int(ids[token, slot])]
            gate_up = x @ w13
            out[token] += float(weights[token, slot]) * ((F.silu(gate_up[:inter]) * gate_up[inter:]) @ w2)
    return out


def routing(tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    logits[:, 3] = -30.0  # expert 3 gets no token
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return hidden, weights, ids


def check_case(case: str, tokens: int, top_k: int, dtype: torch.dtype, device: str) -> None:
    from sparrow_cuda.triton_moe_int4 import TritonInt4FusedMoE

    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype]
    layer = make_layer(case, dtype)
    hidden, weights, ids = routing(tokens, top_k, seed=tokens * 10 + top_k)
    expected = reference(layer, hidden, weights, ids)
    layer = layer.to(device)
    assert TritonInt4FusedMoE.supports(layer)
    impl = TritonInt4FusedMoE(layer)
    impl.process_weights()
    bits = CASES[case][1].get("bits", 4)
    inter = layer.intermediate_size_per_rank
    # Packed, not dense: int32 words holding 32 / bits values along the input.
    assert layer.w13_qweight.shape == (EXPERTS, HIDDEN * bits // 32, 2 * inter)
    assert layer.w2_qweight.shape == (EXPERTS, inter * bits // 32, HIDDEN)
    assert layer.w13_qweight.dtype == torch.int32 and layer.gate_up_proj is None
    assert not [name for name, _ in layer.named_parameters() if name.startswith("0.")]
    got = impl(hidden.to(dtype).to(device), weights.to(device), ids.to(device))
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float().cpu(), expected, atol=tolerance, rtol=tolerance)


@interpreted
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_int4_gemm_interpreted(case):
    for tokens, top_k in ((1, 2), (9, 3)):
        check_case(case, tokens, top_k, torch.float32, "cpu")


@interpreted
def test_grouped_int4_gemm_interpreted_half_top1_and_empty():
    from sparrow_cuda.triton_moe_int4 import TritonInt4FusedMoE

    check_case("awq g16", 6, 1, torch.float16, "cpu")
    check_case("gptq asym g16", 4, 2, torch.bfloat16, "cpu")
    layer = make_layer("gptq asym g16", torch.float32)
    impl = TritonInt4FusedMoE(layer)
    impl.process_weights()
    empty = impl(torch.zeros(0, HIDDEN), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    assert empty.shape == (0, HIDDEN)


def test_dense_experts_are_not_served_packed():
    pytest.importorskip("triton")
    from sparrow_cuda.triton_moe_int4 import TritonInt4FusedMoE

    assert not TritonInt4FusedMoE.supports(FusedMoE(EXPERTS, HIDDEN, INTER))


@compiled
@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_int4_gemm_on_gpu(case, dtype):
    for tokens, top_k in ((1, 2), (9, 3), (300, 2)):
        check_case(case, tokens, top_k, dtype, "cuda")
