"""AWQ and GPTQ checkpoints of mixture-of-experts models (Qwen3-MoE, Mixtral).

Quantizers store every expert's projections as linear layers of their own
(``experts.N.gate_proj.qweight`` / ``qzeros`` / ``scales`` / ``g_idx``; Mixtral's ``w1`` / ``w3`` /
``w2``), routers in full precision. Sparrow loads them as a dense MLP's quantized layers (split over
tensor-parallel ranks the same way); on the CPU it dequantizes them into the stacked experts when
the op is bound (sparrow.quantization.dequant.DequantizedFusedMoE), on CUDA they stay packed
(sparrow_cuda.triton_moe_int4, tested against a float32 reference in tests/test_triton_moe_int4.py).
The reference, as for the dense int4 checkpoints (tests/test_quantization.py): the same weights
dequantized into a float32 checkpoint, run unquantized; nothing else separates the two, so the
logprobs agree to float rounding.
"""

from __future__ import annotations

import pytest
import torch

from sparrow.layers.fused_moe import FusedMoE
from sparrow.tiny import quant_ckpt
from tests.test_quantization import compare, llm, teacher_forced

COMMON = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
MODELS = {
    # layer 0 sparse (5 experts, top-3, renormalised), layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=5, num_experts_per_tok=3, moe_intermediate_size=64,
                      intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1], **COMMON),
    "mixtral": dict(arch="mixtral", num_local_experts=5, num_experts_per_tok=2, intermediate_size=64, **COMMON),
}
CASES = {
    "awq g16": ("awq", dict(group_size=16)),
    "gptq asym g16": ("gptq", dict(group_size=16, sym=False)),
    "gptq sym act-order g32": ("gptq", dict(group_size=32, sym=True, desc_act=True)),
}


@pytest.fixture(scope="module")
def moe_quant_dirs(tmp_path_factory):
    """(model, case) -> (quantized checkpoint, dequantized float32 reference), built on first use."""
    from tests.conftest import build_test_model

    root = tmp_path_factory.mktemp("moe-int4")
    sources: dict[str, str] = {}
    built: dict[tuple[str, str], tuple[str, str]] = {}

    def get(model: str, case: str) -> tuple[str, str]:
        if model not in sources:
            sources[model] = build_test_model(root / model, seed=41 + len(sources), **MODELS[model])
        if (model, case) not in built:
            method, options = CASES[case]
            slug = f"{model}-{case.replace(' ', '-')}"
            built[(model, case)] = quant_ckpt.quantize_model_dir(sources[model], root / slug, root / f"{slug}-ref",
                                                                 method, **options)
        return built[(model, case)]
    return get


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_experts_match_their_dequantized_weights(moe_quant_dirs, model, case):
    quantized_dir, reference_dir = moe_quant_dirs(model, case)
    worst, _, top1 = compare(teacher_forced(quantized_dir), teacher_forced(reference_dir))
    assert worst < 1e-4 and top1 == 1.0, (worst, top1)


def test_the_checkpoint_holds_quantized_experts_and_the_engine_dequantizes_them(moe_quant_dirs):
    from safetensors import safe_open

    quantized_dir, _ = moe_quant_dirs("mixtral", "gptq asym g16")
    with safe_open(f"{quantized_dir}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    layer = "model.layers.0.block_sparse_moe"
    assert {f"{layer}.experts.4.w1.qweight", f"{layer}.experts.4.w2.g_idx", f"{layer}.gate.weight"} <= keys
    assert not any(key.startswith(f"{layer}.experts.") and key.endswith(".weight") for key in keys)
    with llm(quantized_dir) as engine:
        model = engine.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
        moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(not m.quantized and m.gate_up_proj.shape == (5, 128, 64) for m in moes)
        assert all(type(m.op_impl).__name__ == "DequantizedFusedMoE" for m in moes)
        assert not [name for name, _ in model.named_parameters() if ".experts.0." in name]


@pytest.mark.parametrize("model", list(MODELS))
def test_tensor_parallel_two_equals_one(moe_quant_dirs, model):
    """Two ranks (gloo): each expert's gate/up rows and down columns split as a dense MLP's, act
    order included; the result equals one rank's."""
    quantized_dir, _ = moe_quant_dirs(model, "gptq sym act-order g32")
    worst, _, top1 = compare(teacher_forced(quantized_dir, tensor_parallel_size=2), teacher_forced(quantized_dir))
    assert worst < 1e-4 and top1 == 1.0, (worst, top1)


@pytest.mark.cuda
@pytest.mark.parametrize("model", list(MODELS))
def test_quantized_experts_on_a_gpu_match_their_dequantized_weights(moe_quant_dirs, model):
    """On CUDA the experts stay packed and run in the Triton grouped int4 GEMM (fp32 here, as the
    reference); nothing of them is dense."""
    quantized_dir, reference_dir = moe_quant_dirs(model, "gptq asym g16")
    worst, _, top1 = compare(teacher_forced(quantized_dir, device="cuda"), teacher_forced(reference_dir, device="cuda"))
    assert worst < 1e-3 and top1 == 1.0, (worst, top1)
    with llm(quantized_dir, device="cuda") as engine:
        model = engine.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
        moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(type(m.op_impl).__name__ == "TritonInt4FusedMoE" and m.gate_up_proj is None
                            and m.w13_qweight.dtype == torch.int32 for m in moes)
