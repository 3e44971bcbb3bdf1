"""int8 W8A8 on mixture-of-experts models (Qwen3-MoE, Mixtral) on the CPU.

``quantization="int8"`` quantizes every expert's ``gate_up_proj`` / ``down_proj`` on load, per
expert and per output channel, and runs the experts as int8 GEMMs over their routed tokens
(sparrow_cpu.int8.Int8FusedMoE, served through the method's ``fused_moe`` override); the router
stays in float32. The reference is the one tests/test_quantization.py uses for dense int8: the same
int8 weights dequantized into a float32 checkpoint, run unquantized; only the per-token activation
quantization separates the two. The dense statistics apply: mean logprob difference under
INT8_MEAN_ATOL and top-1 agreement >= MIN_TOP1 on teacher-forced positions. The worst case needs
more words: the router sees hidden states that carry the attention layers' int8 error, and where
two experts' router probabilities nearly tie (0.1977 against 0.1961, say) the top-k choice can flip
between the runs; a flip in an early position reaches the later ones through attention and can
move a position's logprob by far more than activation rounding does (seen: 1.61 on a VNNI CPU,
0.60 on an AVX2 one). So the free-running comparison bounds only the share of positions beyond
INT8_ATOL (MAX_OUTLIER_SHARE), and a second int8 run, with every router's expert choice forced to
the reference's, must be within INT8_ATOL everywhere: what is left is activation rounding.
Measured (166 positions per model): on the 2-vCPU Xeon with AVX512-VNNI (8-bit weights), mixtral
free: worst 1.610 (the next 0.243), mean 0.043, top-1 97.0 %, three routing flips; forced: worst
0.123, mean 0.030. On the AVX2 EPYC (7-bit weights): qwen3_moe worst 0.292, mean 0.042, top-1
98.8 %; mixtral worst 0.596, mean 0.035, top-1 99.4 %. Tensor parallel 2 against 1 (both int8,
so both runs carry activation rounding): worst 0.170, mean 0.052, top-1 98.8 % on the AVX2
EPYC; worst 0.275 (one position beyond INT8_ATOL), mean 0.046, top-1 100 % on the VNNI Xeon.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from sparrow import LLM
from sparrow.config import ConfigError
from sparrow.layers.fused_moe import FusedMoE, MoeRouter, select_experts
from sparrow.quantization.fp8 import Fp8Method
from sparrow.quantization.int4 import AwqMethod, GptqMethod
from sparrow.quantization.int8 import Int8Method, quantize_rows
from sparrow_cpu.int8 import Int8FusedMoE, onednn_int8_available, quantize_weight
from tests.test_models_moe import MAX_TOKENS, MODELS, make_prompts, run_engine
from tests.test_quantization import (  # int8_gemm: the fixture, each int8 GEMM in turn
    INT8_ATOL,
    INT8_MEAN_ATOL,
    MIN_TOP1,
    compare,
    int8_gemm,  # noqa: F401
    teacher_forced,
)

pytestmark = pytest.mark.skipif(not onednn_int8_available(), reason="this torch build has no oneDNN int8 linear")

NAMES = ("qwen3_moe", "mixtral")
MAX_OUTLIER_SHARE = 0.02
_int8_runs: dict[str, list] = {}  # teacher-forced int8 results, shared by the tests that need them


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    from tests.conftest import build_test_model

    root = tmp_path_factory.mktemp("moe-int8")
    return {name: build_test_model(root / name, seed=index + 31, **MODELS[name]) for index, name in enumerate(NAMES)}


def int8_teacher_forced(model_dir: str) -> list:
    if model_dir not in _int8_runs:
        _int8_runs[model_dir] = teacher_forced(model_dir, quantization="int8")
    return _int8_runs[model_dir]


def check_int8_statistics(label: str, quantized, reference) -> None:
    worst, mean, top1 = compare(quantized, reference)
    differences = [abs(a - b) for (q_lp, _), (r_lp, _) in zip(quantized, reference) for a, b in zip(q_lp, r_lp)]
    outliers = sum(d >= INT8_ATOL for d in differences) / len(differences)
    print(f"{label}: worst {worst:.3f}, outliers {outliers:.3f}, mean {mean:.4f}, top-1 {top1:.3f}")
    assert mean < INT8_MEAN_ATOL and top1 >= MIN_TOP1, (mean, top1)
    assert outliers <= MAX_OUTLIER_SHARE, (worst, outliers)


def dequantized_reference(model_dir: str, out) -> str:
    """A copy of the checkpoint whose layers' linear and expert weights are their int8 round trip
    (per output channel, the scheme Int8Linear / Int8FusedMoE use); routers stay as they are."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    state = load_file(str(out / "model.safetensors"))
    changed = 0
    for key, tensor in state.items():
        if ".layers." in key and (key.endswith("_proj.weight") or ".experts." in key):
            q, scale = quantize_weight(tensor)
            state[key] = q.float() * scale.unsqueeze(1)
            changed += ".experts." in key
    assert changed, "the checkpoint should name per-expert tensors"
    save_file(state, str(out / "model.safetensors"))
    return str(out)


# -- the op ------------------------------------------------------------------------------------
def test_int8_experts_compute_the_quantized_product_exactly(int8_gemm):  # noqa: F811 - the fixture
    """Int8FusedMoE equals, per token and chosen expert, (per-token int8 x) @ (per-channel int8
    W)^T for gate/up, then the same for down on the per-row int8 gated activation, mixed by weight;
    with our VNNI GEMM and with oneDNN's."""
    from sparrow.ops import bind_ops
    from sparrow.ops.moe_cases import fill_experts

    layer = FusedMoE(7, 32, 24)
    fill_experts(layer, torch.Generator().manual_seed(1))
    gate_up, down = layer.gate_up_proj.data.clone(), layer.down_proj.data.clone()
    assert bind_ops(layer, "cpu", overrides={"fused_moe": Int8FusedMoE}) == {"fused_moe": {"int8_w8a8_moe": 1}}
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(13, 32, generator=gen) * torch.linspace(0.01, 10, 13).unsqueeze(1)
    logits = torch.randn(13, 7, generator=gen)
    logits[:, 6] = -30.0  # an expert no token picks
    weights, ids = select_experts(logits, 3, renormalize=False)
    expected = torch.zeros(13, 32, dtype=torch.float64)
    q_x, s_x = quantize_rows(hidden)
    for token in range(13):
        for slot in range(3):
            expert = int(ids[token, slot])
            (q_gu, s_gu), (q_d, s_d) = quantize_weight(gate_up[expert]), quantize_weight(down[expert])
            gu = (q_gu.double() @ q_x[token].double()) * s_gu.double() * s_x[token].double()
            act = torch.nn.functional.silu(gu[:24]) * gu[24:]
            q_a, s_a = quantize_rows(act.float().unsqueeze(0))
            expected[token] += weights[token, slot].double() * (q_d.double() @ q_a[0].double()) * s_d.double() * s_a
    torch.testing.assert_close(layer(hidden, weights, ids).double(), expected, rtol=1e-5, atol=1e-5)
    assert layer(hidden[:0], weights[:0], ids[:0]).shape == (0, 32)
    layer.op_impl.native = None  # the torch ops used when the C++ activation kernels cannot be built
    torch.testing.assert_close(layer(hidden, weights, ids).double(), expected, rtol=1e-5, atol=1e-5)


class GatheredAmax:
    """A stand-in for the gloo group of two ranks bound one after the other: all_gather returns
    what every rank would contribute (precomputed from the ranks' loaded weights), in rank order."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.parts, dim=dim)


def test_int8_expert_scales_are_split_with_the_weights():
    """Two ranks: each keeps its gate/up rows' scales and the whole rows' down_proj scales, so
    each holds exactly its slice of the single-device int8 experts; the partial outputs sum to
    about the single-device output (the gated activation is quantized per rank slice)."""
    from sparrow.layers.parallel import ParallelContext
    from sparrow.ops import bind_ops
    from sparrow.ops.moe_cases import fill_experts

    full = FusedMoE(5, 32, 24)
    fill_experts(full, torch.Generator().manual_seed(4))
    comm = GatheredAmax()
    ranks = [FusedMoE(5, 32, 24, tp=ParallelContext(rank, 2, communicator=comm)) for rank in range(2)]
    for layer in ranks:
        layer.weight_loader(layer.gate_up_proj, full.gate_up_proj.data)
        layer.weight_loader(layer.down_proj, full.down_proj.data)
        comm.parts.append(layer.down_proj.data.abs().amax(dim=2).unsqueeze(-1))
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(11, 32, generator=gen)
    weights, ids = select_experts(torch.randn(11, 5, generator=gen), 2, renormalize=True)
    for layer in (full, *ranks):
        bind_ops(layer, "cpu", overrides={"fused_moe": Int8FusedMoE})
    for rank, layer in enumerate(ranks):
        mine = slice(rank * 12, (rank + 1) * 12)
        assert torch.equal(layer.gate_up_scale, torch.cat([full.gate_up_scale[:, :24][:, mine],
                                                           full.gate_up_scale[:, 24:][:, mine]], dim=1))
        assert torch.equal(layer.down_scale, full.down_scale)
    total = sum(layer.op_impl(hidden, weights, ids) for layer in ranks)
    expected = full(hidden, weights, ids)
    assert (total - expected).abs().max() < 0.02 * expected.abs().max()


# -- the engine --------------------------------------------------------------------------------
class RoutingRecorder:
    """Stands in for sparrow.layers.fused_moe.select_experts: records every call's expert ids, or,
    given a recording, returns its ids in the same order with weights from this run's router."""

    def __init__(self, forced: list[torch.Tensor] | None = None) -> None:
        self.ids: list[torch.Tensor] = []
        self.forced = iter(forced) if forced is not None else None

    def __call__(self, router_logits: torch.Tensor, top_k: int, renormalize: bool):
        if self.forced is None:
            weights, ids = select_experts(router_logits, top_k, renormalize)
        else:
            ids = next(self.forced)
            assert ids.shape == (router_logits.shape[0], top_k), "both runs should schedule the same steps"
            weights = torch.softmax(router_logits, dim=-1, dtype=torch.float32).gather(1, ids)
            if renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        self.ids.append(ids.clone())
        return weights, ids


@pytest.mark.parametrize("name", NAMES)
def test_int8_moe_matches_dequantized_weights(name, moe_dirs, tmp_path, monkeypatch):
    import sparrow.layers.fused_moe as fused_moe

    reference_dir = dequantized_reference(moe_dirs[name], tmp_path / "int8-ref")
    recorded = RoutingRecorder()
    monkeypatch.setattr(fused_moe, "select_experts", recorded)
    reference = teacher_forced(reference_dir)
    monkeypatch.undo()
    check_int8_statistics(name, int8_teacher_forced(moe_dirs[name]), reference)

    # The same int8 run with the reference's expert choices: only activation rounding is left.
    forced = RoutingRecorder(forced=recorded.ids)
    monkeypatch.setattr(fused_moe, "select_experts", forced)
    worst, mean, top1 = compare(teacher_forced(moe_dirs[name], quantization="int8"), reference)
    print(f"{name} with the reference's routing: worst {worst:.3f}, mean {mean:.4f}, top-1 {top1:.3f}")
    assert len(forced.ids) == len(recorded.ids) > 0
    assert worst < INT8_ATOL and mean < INT8_MEAN_ATOL and top1 >= MIN_TOP1, (worst, mean, top1)


def test_int8_moe_generates_with_chunked_prefill_and_prefix_caching(moe_dirs):
    """Greedy decoding end to end (16-token chunks, prefix cache on); the int8 expert weights take
    about a quarter of their float32 bytes (int8 values plus float32 per-channel scales)."""
    prompts = make_prompts(seed=5)
    llm = LLM(moe_dirs["qwen3_moe"], multiprocess=False, quantization="int8", dtype="float32", max_model_len=128,
              enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True, num_kv_blocks=32,
              block_size=16)
    try:
        first, _, _ = run_engine(llm, prompts)
        second, _, cached = run_engine(llm, prompts)
        model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    finally:
        llm.shutdown()
    assert cached > 0, "the second pass should hit the prefix cache"
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in first)
    assert [tokens for tokens, _ in second] == [tokens for tokens, _ in first]

    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(type(m.op_impl).__name__ == "Int8FusedMoE" for m in experts)
    routers = [m for m in model.modules() if isinstance(m, MoeRouter)]
    assert routers and all(m.weight.dtype == torch.float32 for m in routers)  # routing in full precision
    stored = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
    dense = sum(m.num_experts * 3 * m.intermediate_size_per_rank * m.hidden_size * 4 for m in experts)
    assert all(p.dtype == torch.int8 for m in experts for p in (*m.gate_up_proj, *m.down_proj))
    assert 0.25 <= stored / dense < 0.3, stored / dense


def test_int8_moe_tensor_parallel_2_matches_1(moe_dirs):
    """Two ranks split every expert's intermediate size and its scales: gate/up rows keep their own
    scales, down_proj's come from whole rows, so each rank holds its slice of the single-device
    int8 weights; only the per-token quantization of the split gated activation differs."""
    model_dir = moe_dirs["qwen3_moe"]
    check_int8_statistics("tp2 vs tp1", teacher_forced(model_dir, quantization="int8", tensor_parallel_size=2),
                          int8_teacher_forced(model_dir))


# -- configuration -----------------------------------------------------------------------------
def _config(device: str) -> SimpleNamespace:
    return SimpleNamespace(device=SimpleNamespace(device=device), model=SimpleNamespace(dtype="auto"),
                           parallel=SimpleNamespace(tensor_parallel_size=1))


def test_a_method_without_an_experts_op_refuses_moe_models():
    """A method (a plugin's, say) that serves ``linear`` but not ``fused_moe`` on the device."""
    class LinearOnly(Fp8Method):
        implementations = {"cuda": {"linear": "sparrow.quantization.fp8:Fp8Linear"}}

    method = LinearOnly(None)
    method.hf_config = SimpleNamespace(num_local_experts=8)
    with pytest.raises(ConfigError, match=r"'quantization': 'fp8' does not quantize mixture-of-experts models "
                                          r"\(config.json has num_local_experts\) on device 'cuda'; of the built-in "
                                          r"methods 'int8' does on the CPU, 'fp8' on CUDA, and 'awq' and 'gptq'"):
        method.check_config(_config("cuda"))


def test_fp8_accepts_moe_models_on_cuda():
    method = Fp8Method(None)
    method.hf_config = SimpleNamespace(num_local_experts=8)
    method.check_config(_config("cuda"))
    assert method.implementations["cuda"]["fused_moe"] == "sparrow_cuda.triton_moe:TritonFp8FusedMoE"


@pytest.mark.parametrize("method_cls", [AwqMethod, GptqMethod])
def test_awq_and_gptq_serve_moe_models_on_both_platforms(method_cls):
    """Their checkpoints' experts load (tests/test_quantization_moe_int4.py runs them): dequantized
    on the CPU, packed on CUDA (tests/test_triton_moe_int4.py)."""
    assert method_cls.implementations["cpu"]["fused_moe"] == "sparrow.quantization.dequant:DequantizedFusedMoE"
    assert method_cls.implementations["cuda"]["fused_moe"] == "sparrow_cuda.triton_moe_int4:TritonInt4FusedMoE"


def test_int8_accepts_moe_models():
    method = Int8Method(None)
    method.hf_config = SimpleNamespace(num_experts=4)
    method.check_config(_config("cpu"))
    assert set(method.op_overrides("cpu")) == {"linear", "fused_moe"}
