"""fp8 W8A8 on mixture-of-experts models (Qwen3-MoE, Mixtral).

``quantization="fp8"`` quantizes every expert's ``gate_up_proj`` / ``down_proj`` per expert and
output channel on load, or stacks an fp8 checkpoint's per-expert weights as they are; each GEMM's
input is quantized per row (sparrow.quantization.fp8.Fp8FusedMoE). On CUDA a Triton grouped GEMM
multiplies the fp8 operands (tests/test_triton_moe.py checks it against the emulated product,
interpreted on the CPU); here the engine runs the emulated product on the CPU through the test
plugin of tests/test_quantization.py that offers the built-in fp8 method there.

The reference, as for dense fp8: the same fp8 weights dequantized into a float32 checkpoint, run
unquantized; only the per-row fp8 activations separate the two, so the dense fp8 statistics apply
(mean logprob difference under FP8_MEAN_ATOL, top-1 agreement at least FP8_MIN_TOP1), and, as
tests/test_quantization_moe.py explains for int8, the worst case may exceed FP8_ATOL where a near
tie between two experts' router probabilities flips (at most MAX_OUTLIER_SHARE of positions).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from sparrow.layers.fused_moe import FusedMoE, select_experts
from sparrow.ops import bind_ops
from sparrow.ops.moe_cases import fill_experts
from sparrow.quantization.fp8 import FP8, Fp8FusedMoE, dequantize_fp8_rows, quantize_fp8_rows
from sparrow.tiny import quant_ckpt
from tests.test_models_moe import MODELS
from tests.test_quantization import (  # noqa: F401 - fp8_on_cpu is a fixture
    FP8_ATOL,
    FP8_MEAN_ATOL,
    FP8_MIN_TOP1,
    compare,
    fp8_on_cpu,
    teacher_forced,
)

NAMES = ("qwen3_moe", "mixtral")
MAX_OUTLIER_SHARE = 0.03


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    from tests.conftest import build_test_model

    root = tmp_path_factory.mktemp("moe-fp8")
    return {name: build_test_model(root / name, seed=index + 51, **MODELS[name]) for index, name in enumerate(NAMES)}


def round_trip_reference(model_dir: str, out) -> str:
    """A copy whose decoder linear and expert weights are their fp8 round trip per output channel
    (what quantization on load does); routers stay as they are."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    state = load_file(str(out / "model.safetensors"))
    experts = 0
    for key, tensor in state.items():
        if quant_ckpt._is_decoder_linear(key, tensor):
            state[key] = dequantize_fp8_rows(*quantize_fp8_rows(tensor))
            experts += ".experts." in key
    assert experts, "the checkpoint should name per-expert tensors"
    save_file(state, str(out / "model.safetensors"))
    return str(out)


def check_statistics(label: str, quantized, reference) -> None:
    worst, mean, top1 = compare(quantized, reference)
    differences = [abs(a - b) for (q_lp, _), (r_lp, _) in zip(quantized, reference) for a, b in zip(q_lp, r_lp)]
    outliers = sum(d >= FP8_ATOL for d in differences) / len(differences)
    print(f"{label}: worst {worst:.3f}, outliers {outliers:.3f}, mean {mean:.4f}, top-1 {top1:.3f}")
    assert mean < FP8_MEAN_ATOL and top1 >= FP8_MIN_TOP1, (mean, top1)
    assert outliers <= MAX_OUTLIER_SHARE, (worst, outliers)


# -- the op ------------------------------------------------------------------------------------
def test_fp8_experts_compute_the_quantized_product():
    """Per token and chosen expert: (per-token fp8 x) @ (per-channel fp8 W)^T for gate/up, then the
    same for down on the per-row fp8 gated activation, mixed by routing weight."""
    layer = FusedMoE(5, 64, 40)
    fill_experts(layer, torch.Generator().manual_seed(3))
    gate_up, down = layer.gate_up_proj.data.clone(), layer.down_proj.data.clone()
    bind_ops(layer, "cpu", overrides={"fused_moe": Fp8FusedMoE})
    assert layer.gate_up_proj.dtype == FP8 and layer.down_proj.dtype == FP8
    assert layer.gate_up_scale.shape == (5, 80) and layer.down_scale.shape == (5, 64)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 64, generator=gen)
    weights, ids = select_experts(torch.randn(9, 5, generator=gen), 2, renormalize=True)

    def fp8(x):
        return dequantize_fp8_rows(*quantize_fp8_rows(x)).double()

    expected = torch.zeros(9, 64, dtype=torch.float64)
    for token in range(9):
        x = fp8(hidden[token:token + 1])
        for slot in range(2):
            e = int(ids[token, slot])
            g_u = (x @ fp8(gate_up[e]).t()).float()
            act = F.silu(g_u[:, :40]) * g_u[:, 40:]
            expected[token] += float(weights[token, slot]) * (fp8(act) @ fp8(down[e]).t())[0]
    torch.testing.assert_close(layer(hidden, weights, ids).double(), expected, rtol=1e-5, atol=1e-5)


# -- the engine (the emulated product on the CPU) ------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_fp8_quantized_on_load_matches_dequantized_weights(name, moe_dirs, fp8_on_cpu, tmp_path):
    reference_dir = round_trip_reference(moe_dirs[name], tmp_path / "fp8-ref")
    check_statistics(name, teacher_forced(moe_dirs[name], quantization="fp8"), teacher_forced(reference_dir))


def test_fp8_checkpoints_load_their_experts_as_they_are(moe_dirs, fp8_on_cpu, tmp_path):
    """Mixtral's per-expert ``w1``/``w3``/``w2`` ``weight`` (float8_e4m3fn) and per-tensor
    ``weight_scale`` are stacked unchanged (no requantization) when the op is bound."""
    from safetensors import safe_open

    from tests.test_quantization import llm

    quantized_dir, reference_dir = quant_ckpt.quantize_model_dir(moe_dirs["mixtral"], tmp_path / "fp8",
                                                                 tmp_path / "fp8-ref", "fp8")
    with safe_open(f"{quantized_dir}/model.safetensors", "pt") as f:
        w1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.2.w1.weight")
        scale = f.get_tensor("model.layers.0.block_sparse_moe.experts.2.w1.weight_scale")
    with llm(quantized_dir, quantization="fp8") as engine:
        model = engine.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
        moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(type(m.op_impl).__name__ == "Fp8FusedMoE" and not m.quantized for m in moes)
        first = next(m for m in moes if m.tp.rank == 0)
        assert torch.equal(first.gate_up_proj[2, :w1.shape[0]].view(torch.uint8), w1.view(torch.uint8))
        assert torch.equal(first.gate_up_scale[2, :w1.shape[0]], scale.float().expand(w1.shape[0]))
        assert not [n for n, _ in model.named_parameters() if ".experts.0." in n]
    check_statistics("mixtral fp8 checkpoint", teacher_forced(quantized_dir, quantization="fp8"),
                     teacher_forced(reference_dir))


def test_fp8_checkpoint_experts_split_over_two_ranks():
    """Two ranks load an fp8 checkpoint's experts (each rank its gate/up rows and down columns, the
    per-tensor scales whole) and their partial sums add up to one rank's output; only the per-row
    quantization of the split gated activation differs."""
    from sparrow.layers.fused_moe import DOWN, GATE, UP
    from sparrow.layers.parallel import ParallelContext
    from sparrow.quantization import quantization_scope
    from sparrow.quantization.fp8 import Fp8Method

    method = Fp8Method({"quant_method": "fp8", "activation_scheme": "dynamic"})
    gen = torch.Generator().manual_seed(8)
    checkpoint = {(projection, expert): quant_ckpt.fp8_tensors(
        torch.randn(*((64, 48) if projection == DOWN else (48, 64)), generator=gen) * 0.2, static=False)[0]
        for expert in range(5) for projection in (GATE, UP, DOWN)}
    layers = []
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        with quantization_scope(method):
            layer = FusedMoE(5, 64, 48, tp=ParallelContext(rank, world, communicator=object()))
        assert layer.quantized
        for (projection, expert), tensors in checkpoint.items():
            linear = layer.get_submodule(f"{expert}.{'down_proj' if projection == DOWN else 'gate_up_proj'}")
            for key, value in tensors.items():
                param = getattr(linear, key)
                param.weight_loader(param, value, *(() if projection == DOWN else (int(projection == UP),)))
        bind_ops(layer, "cpu", overrides={"fused_moe": Fp8FusedMoE})
        layers.append(layer)
    single, *ranks = layers
    assert ranks[1].gate_up_proj.shape == (5, 48, 64) and ranks[1].down_proj.shape == (5, 64, 24)
    assert torch.equal(ranks[1].down_scale, single.down_scale)
    hidden = torch.randn(7, 64, generator=gen)
    weights, ids = select_experts(torch.randn(7, 5, generator=gen), 2, renormalize=True)
    expected = single.op_impl(hidden, weights, ids)
    total = sum(layer.op_impl(hidden, weights, ids) for layer in ranks)  # the all-reduce, by hand
    assert (total - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_fp8_moe_on_a_gpu_matches_dequantized_weights(name, moe_dirs, tmp_path):
    """The built-in fp8 method on CUDA: the experts in the Triton fp8 grouped GEMM."""
    from tests.test_quantization import llm

    reference_dir = round_trip_reference(moe_dirs[name], tmp_path / "fp8-ref")
    check_statistics(name, teacher_forced(moe_dirs[name], quantization="fp8", device="cuda"),
                     teacher_forced(reference_dir, device="cuda"))
    with llm(moe_dirs[name], quantization="fp8", device="cuda") as engine:
        model = engine.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
        moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(type(m.op_impl).__name__ == "TritonFp8FusedMoE" for m in moes)
