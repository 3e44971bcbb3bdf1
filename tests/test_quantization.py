"""Quantization methods (sparrow.quantization): int8 W8A8 on the CPU, AWQ and GPTQ int4 checkpoints,
fp8 W8A8, registered through the same hook as a plugin's.

Every quantized path is checked against a reference that dequantizes the same weights in float32
(sparrow.tiny.quant_ckpt writes both a checkpoint in the published layout and that reference):

* layer level: the weights a layer loads (per tensor-parallel rank, fused projections included)
  dequantize to exactly the reference's values;
* engine level (``sparrow.LLM(model=..., dtype="float32")``, random-weight Qwen3 test model): the
  teacher-forced prompt logprobs and their top-1 tokens, against the engine running the reference
  checkpoint unquantized. AWQ/GPTQ on the CPU (dequantized once at load): logprobs within 1e-4 and
  every top-1 equal. int8 and fp8 (activations quantized per token too): logprobs within
  INT8_ATOL / FP8_ATOL at worst and INT8_MEAN_ATOL / FP8_MEAN_ATOL on average, and top-1 agreement
  on at least 95 % (int8) / 90 % (fp8) of positions (the random-weight model's teacher-forced logprobs average about
  -16 nats with a spread of 4: a mean difference of 0.04 is 0.25 % of them).

Configuration refusals name the field.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
import torch

from sparrow.config import ConfigError
from sparrow.hookspecs import hookimpl
from sparrow.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sparrow.layers.parallel import ParallelContext
from sparrow.quantization import quantization_scope
from sparrow.quantization.fp8 import Fp8Method, dequantize_fp8_rows, quantize_fp8_rows
from sparrow.quantization.int4 import AwqMethod, GptqMethod, pack, unpack
from sparrow.quantization.int8 import dequantize_rows, quantize_rows
from sparrow.tiny import quant_ckpt

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)
PROMPT_LENGTHS = (9, 40, 120)
# Per-token activation quantization is all that separates these runs from their references.
INT8_ATOL, INT8_MEAN_ATOL = 0.25, 0.06
# e4m3 keeps 3 mantissa bits: a per-token fp8 activation is within 1/16 of its value, against
# 1/254 of its row's largest value for int8, and the random model's large logits show it.
FP8_ATOL, FP8_MEAN_ATOL, FP8_MIN_TOP1 = 0.8, 0.2, 0.90
MIN_TOP1 = 0.95


# -- helpers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def llm(model_dir: str, **kwargs):
    from sparrow import LLM

    engine = LLM(model_dir, multiprocess=False, **{**ENGINE_ARGS, **kwargs})
    try:
        yield engine
    finally:
        engine.shutdown()


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, vocab_size - 1) for _ in range(n)] for n in PROMPT_LENGTHS]


def teacher_forced(model_dir: str, **kwargs) -> list[tuple[list[float], list[int]]]:
    """Per prompt: the logprob of every prompt token given the ones before it, and the top-1 token
    at every position."""
    from sparrow import SamplingParams
    from sparrow.model_loader import get_hf_config

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    with llm(model_dir, **kwargs) as engine:
        outputs = engine.generate([{"prompt_token_ids": p} for p in prompts(get_hf_config(model_dir).vocab_size)],
                                  params, use_tqdm=False)
    results = []
    for output in outputs:
        logprobs, top1 = [], []
        for token, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
            logprobs.append(position[token].logprob)
            top1.append(next(t for t, lp in position.items() if lp.rank == 1))
        results.append((logprobs, top1))
    return results


def compare(quantized, reference) -> tuple[float, float, float]:
    """(largest and mean logprob difference, share of positions whose top-1 token agrees)."""
    worst, summed, agree, total = 0.0, 0.0, 0, 0
    for (q_lp, q_top), (r_lp, r_top) in zip(quantized, reference):
        differences = [abs(a - b) for a, b in zip(q_lp, r_lp)]
        worst, summed = max(worst, max(differences)), summed + sum(differences)
        agree += sum(a == b for a, b in zip(q_top, r_top))
        total += len(q_top)
    return worst, summed / total, agree / total


@pytest.fixture(scope="module")
def quant_dirs(qwen3_dir, tmp_path_factory):
    """name -> (quantized checkpoint, dequantized float32 reference), built on first use."""
    root = tmp_path_factory.mktemp("quantized")
    built: dict[str, tuple[str, str]] = {}

    def get(name: str, method: str, **options) -> tuple[str, str]:
        if name not in built:
            built[name] = quant_ckpt.quantize_model_dir(qwen3_dir, root / name, root / f"{name}-ref", method, **options)
        return built[name]
    return get


# -- packing and quantization math -------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_and_unpack_are_inverse(bits):
    values = torch.randint(0, 2 ** bits, (16, 24), dtype=torch.int32)
    for dim in (0, 1):
        packed = pack(values, bits, dim)
        assert packed.dtype == torch.int32 and packed.shape[dim] == values.shape[dim] * bits // 32
        assert torch.equal(unpack(packed, bits, dim), values)


def test_awq_nibble_order_is_autoawqs():
    # One row of 8 columns holding 0..7: AutoAWQ puts column (0,2,4,6,1,3,5,7)[i] in nibble i.
    weight = torch.zeros(8, 32)
    tensors, _ = quant_ckpt.awq_tensors(weight, 32)
    assert tensors["qweight"].shape == (32, 1)
    q = torch.arange(8, dtype=torch.int64).unsqueeze(0)
    word = sum(int(q[0, col]) << (4 * i) for i, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)))
    assert word == 0x75316420
    assert torch.equal(AwqMethod(None).linear_weights(None)._columns(torch.tensor([[word]], dtype=torch.int32)),
                       torch.arange(8, dtype=torch.int32).unsqueeze(0))


def test_int8_and_fp8_row_quantization_round_trip():
    x = torch.randn(5, 64) * torch.tensor([0.01, 1.0, 30.0, 0.0, 2.0]).unsqueeze(1)
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    # Symmetric rounding: every value within half a step of its row's scale.
    assert torch.all((dequantize_rows(q, scale) - x).abs() <= scale.unsqueeze(1) / 2 + 1e-7)
    assert torch.equal(dequantize_rows(q, scale)[3], torch.zeros(64))
    q8, scale8 = quantize_fp8_rows(x)
    assert q8.dtype == torch.float8_e4m3fn
    error = (dequantize_fp8_rows(q8, scale8) - x).abs()
    assert torch.all(error <= x.abs() * 2 ** -4 + scale8.unsqueeze(1) * 2 ** -9)  # e4m3: 3 mantissa bits


# -- layers: loading per shard and per rank ------------------------------------------------------
LAYER_CASES = {
    "awq g32": (AwqMethod, "awq", dict(group_size=32)),
    "gptq asym g16": (GptqMethod, "gptq", dict(group_size=16, bits=4, sym=False)),
    "gptq sym act-order g16": (GptqMethod, "gptq", dict(group_size=16, bits=4, sym=True, desc_act=True)),
    "gptq 8-bit g-1": (GptqMethod, "gptq", dict(group_size=-1, bits=8, sym=True)),
    "fp8": (Fp8Method, "fp8", {}),
}


def _checkpoint_tensors(method: str, weight: torch.Tensor, options: dict, key: str):
    if method == "awq":
        return quant_ckpt.awq_tensors(weight, options["group_size"])
    if method == "gptq":
        perm = quant_ckpt.act_order_permutation(key, weight.shape[1]) if options.get("desc_act") else None
        return quant_ckpt.gptq_tensors(weight, options["group_size"], options["bits"], options["sym"], perm)
    return quant_ckpt.fp8_tensors(weight, static=False)


def _quant_config(method: str, options: dict) -> dict:
    return quant_ckpt._quant_config(method, options.get("group_size", 32), options.get("bits", 4),
                                    options.get("sym", False), options.get("desc_act", False), "dynamic")


@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize("world_size", [1, 2])
def test_quantized_layers_load_each_rank_and_shard(case, world_size):
    """Fused QKV (per projection, shared act-order permutation) and row-parallel layers, on every
    rank: the loaded weights dequantize exactly to the checkpoint's reference values."""
    method_cls, method, options = LAYER_CASES[case]
    quant = method_cls(_quant_config(method, options))
    gen = torch.Generator().manual_seed(0)
    hidden, head_dim, heads, kv_heads, inter = 64, 16, 4, 2, 128
    q_w, k_w, v_w = (torch.randn(n * head_dim, hidden, generator=gen) for n in (heads, kv_heads, kv_heads))
    down_w = torch.randn(hidden, inter, generator=gen)
    parts = {name: _checkpoint_tensors(method, w, options, "attn" if name != "down" else "down")
             for name, w in (("q", q_w), ("k", k_w), ("v", v_w), ("down", down_w))}
    qkv_ranks, down_ranks = [], []
    for rank in range(world_size):
        tp = ParallelContext(rank, world_size, communicator=object())
        with quantization_scope(quant):
            qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp=tp, params_dtype=torch.float32)
            down = RowParallelLinear(inter, hidden, tp=tp, params_dtype=torch.float32)
        assert not hasattr(qkv, "weight") or method == "fp8"
        for shard in ("q", "k", "v"):
            for name, tensor in parts[shard][0].items():
                getattr(qkv, name).weight_loader(getattr(qkv, name), tensor, shard)
        for name, tensor in parts["down"][0].items():
            getattr(down, name).weight_loader(getattr(down, name), tensor)
        qkv_ranks.append(qkv.weights.dense_weight(qkv))
        down_ranks.append(down.weights.dense_weight(down))
    q_ref, k_ref, v_ref, down_ref = (parts[n][1] for n in ("q", "k", "v", "down"))
    # Rank r holds [q_r; k_r; v_r] (rows) of the QKV layer and input columns r of the row-parallel one.
    for rank, got in enumerate(qkv_ranks):
        q_rows, kv_rows = q_ref.shape[0] // world_size, k_ref.shape[0] // world_size
        expected = torch.cat([t[rank * n:(rank + 1) * n] for t, n in ((q_ref, q_rows), (k_ref, kv_rows),
                                                                      (v_ref, kv_rows))])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(down_ranks, dim=1), down_ref, rtol=0, atol=0)


def test_a_misshapen_quantized_tensor_names_the_shapes():
    quant = AwqMethod(_quant_config("awq", dict(group_size=32)))
    with quantization_scope(quant):
        layer = ColumnParallelLinear(64, 32)
    with pytest.raises(ValueError, match=r"checkpoint shape \(64, 8\) does not match ColumnParallelLinear: "
                                         r"expected \(64, 4\)"):
        layer.qweight.weight_loader(layer.qweight, torch.zeros(64, 8, dtype=torch.int32))


# -- the engine: quantized checkpoints against their dequantized reference ------------------------
@pytest.mark.parametrize("name, method, options", [
    ("awq", "awq", dict(group_size=32)),
    ("gptq-asym", "gptq", dict(group_size=16, sym=False)),
    ("gptq-act-order", "gptq", dict(group_size=32, sym=True, desc_act=True)),
])
def test_int4_checkpoints_match_their_dequantized_weights(quant_dirs, name, method, options):
    quantized_dir, reference_dir = quant_dirs(name, method, **options)
    # quantization is detected from config.json (as vLLM does) and also accepted when named.
    quantized = teacher_forced(quantized_dir)
    worst, _, top1 = compare(quantized, teacher_forced(reference_dir))
    assert worst < 1e-4 and top1 == 1.0, (worst, top1)
    worst_named, _, _ = compare(teacher_forced(quantized_dir, quantization=method), quantized)
    assert worst_named == 0.0


def test_int8_w8a8_matches_dequantized_weights(qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from sparrow_cpu.int8 import quantize_weight

    # The reference: the same per-channel int8 weights, dequantized, run in float32 unquantized.
    reference_dir = tmp_path / "int8-ref"
    import shutil

    shutil.copytree(qwen3_dir, reference_dir)
    state = load_file(str(reference_dir / "model.safetensors"))
    for key, tensor in state.items():
        if ".layers." in key and key.endswith("_proj.weight"):
            state[key] = dequantize_rows(*quantize_weight(tensor))
    save_file(state, str(reference_dir / "model.safetensors"))

    quantized = teacher_forced(qwen3_dir, quantization="int8")
    worst, mean, top1 = compare(quantized, teacher_forced(str(reference_dir)))
    assert worst < INT8_ATOL and mean < INT8_MEAN_ATOL and top1 >= MIN_TOP1, (worst, mean, top1)


@pytest.fixture(params=["auto", "onednn"])
def int8_gemm(request, monkeypatch):
    """Each int8 GEMM this machine has: ours on AVX512-VNNI (sparrow_cpu.int8_gemm; "auto" is
    oneDNN's elsewhere) and oneDNN's (``SPARROW_CPU_INT8_GEMM=onednn``)."""
    from sparrow_cpu.int8 import vnni_kernels

    monkeypatch.setenv("SPARROW_CPU_INT8_GEMM", request.param)
    vnni_kernels.cache_clear()
    yield request.param
    vnni_kernels.cache_clear()


def test_int8_linear_computes_the_quantized_product_exactly(int8_gemm):
    """The int8 layer equals (per-token int8 x) @ (per-channel int8 W)^T in float32 (the integer
    sums are exact; only the final scaling rounds), with either GEMM."""
    from sparrow.ops import bind_ops
    from sparrow_cpu.int8 import Int8Linear, onednn_int8_available, quantize_weight, vnni_kernels

    if vnni_kernels() is None and not onednn_int8_available():
        pytest.skip("neither int8 GEMM is available here (no AVX512-VNNI kernel, no oneDNN int8 linear)")
    gen = torch.Generator().manual_seed(3)
    layer = ColumnParallelLinear(96, 40, bias=True)
    weight, bias = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.weight_loader(layer.bias, bias)
    q_w, s_w = quantize_weight(weight)
    assert bind_ops(layer, "cpu", overrides={"linear": Int8Linear}) == {"linear": {"int8_w8a8": 1}}
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (40,)
    assert (layer.op_impl.vnni is not None) == (int8_gemm == "auto" and vnni_kernels() is not None)
    x = torch.randn(7, 96, generator=gen) * torch.linspace(0.01, 10, 7).unsqueeze(1)
    q_x, s_x = quantize_rows(x)
    expected = (q_x.double() @ q_w.double().t()) * s_x.double().unsqueeze(1) * s_w.double() + bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert layer(x[:0]).shape == (0, 40)
    if layer.op_impl.vnni is None:
        layer.op_impl.native = None  # the torch ops used when the C++ activation kernels cannot be built
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(params=[2, 16], ids=["2-threads", "16-threads"])
def torch_threads(request):
    """16 threads make the kernel split channels into 32- and 16-wide blocks (fewer than two
    64-channel items per thread); oversubscribed on a small machine, which only costs time."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 67, 131])
@pytest.mark.parametrize("in_features, out_features", [(96, 40), (13, 17), (130, 200), (64, 64)])
def test_the_vnni_kernel_covers_every_tile_edge(rows, in_features, out_features, torch_threads):
    """Our AVX512-VNNI kernel at tile edges: rows not a multiple of the 4-row tile or of the 64-row
    block, channels not a multiple of 16 or of the channel block, inputs not a multiple of 4, rows
    of zeros, with and without a bias; the integer sums exact, checked against float64."""
    from sparrow_cpu.int8 import quantize_weight, vnni_kernels

    kernels = vnni_kernels()
    if kernels is None:
        pytest.skip("no AVX512-VNNI kernel on this CPU/compiler (oneDNN's GEMM is used)")
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    q_w, s_w = quantize_weight(weight)
    x = torch.randn(rows, in_features, generator=gen) * 3
    x[rows // 2] = 0  # a zero row: scale 1, every product zero
    q_x, s_x = quantize_rows(x)
    packed = kernels.vnni_pack(q_w)
    colsum = q_w.sum(dim=1, dtype=torch.int32)
    exact = q_x.double() @ q_w.double().t()
    for bias in (torch.empty(0), torch.randn(out_features, generator=gen)):
        got = kernels.int8_linear(x, packed, in_features, colsum, s_w, bias).double()
        expected = exact * s_x.double().unsqueeze(1) * s_w.double() + (bias.double() if bias.numel() else 0)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # A strided input (a view of wider rows) is read in place.
    wide = torch.randn(rows, in_features + 8, generator=gen)
    view = wide[:, 4:4 + in_features]
    q_v, s_v = quantize_rows(view.contiguous())
    torch.testing.assert_close(kernels.int8_linear(view, packed, in_features, colsum, s_w, torch.empty(0)).double(),
                               (q_v.double() @ q_w.double().t()) * s_v.double().unsqueeze(1) * s_w.double(),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        kernels.int8_linear(x[:, :-1], packed, in_features, colsum, s_w, torch.empty(0))


# -- fp8 --------------------------------------------------------------------------------------------
class CpuFp8(Fp8Method):
    """The built-in fp8 method with its emulated GEMM also offered on the CPU: what a vendor's
    override looks like, and how fp8 runs through the engine without a GPU."""

    implementations = {**Fp8Method.implementations, "cpu": {"linear": "sparrow.quantization.fp8:Fp8Linear",
                                                            "fused_moe": "sparrow.quantization.fp8:Fp8FusedMoE"}}


class CpuFp8Plugin:
    @hookimpl
    def sparrow_register_quantization_methods(self, register) -> None:
        register("fp8", CpuFp8, override=True)


@pytest.fixture
def fp8_on_cpu():
    from sparrow.plugins import get_plugin_manager, register_plugin

    pm = get_plugin_manager()
    register_plugin(pm, CpuFp8Plugin(), "cpu_fp8_test")
    try:
        yield
    finally:
        pm.unregister(name="cpu_fp8_test")


def test_fp8_linear_computes_the_quantized_product():
    from sparrow.ops import bind_ops
    from sparrow.quantization.fp8 import Fp8Linear

    gen = torch.Generator().manual_seed(5)
    layer = RowParallelLinear(64, 24, bias=True)
    weight, bias = torch.randn(24, 64, generator=gen), torch.randn(24, generator=gen)
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.weight_loader(layer.bias, bias)
    bind_ops(layer, "cpu", overrides={"linear": Fp8Linear})
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (1, 24)
    x = torch.randn(5, 64, generator=gen)
    q_w, s_w = quantize_fp8_rows(weight)
    q_x, s_x = quantize_fp8_rows(x)
    expected = dequantize_fp8_rows(q_x, s_x).double() @ dequantize_fp8_rows(q_w, s_w).double().t() + bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_fp8_checkpoints_match_their_dequantized_weights(quant_dirs, fp8_on_cpu, scheme):
    quantized_dir, reference_dir = quant_dirs(f"fp8-{scheme}", "fp8", activation_scheme=scheme)
    worst, mean, top1 = compare(teacher_forced(quantized_dir), teacher_forced(reference_dir))
    assert worst < FP8_ATOL and mean < FP8_MEAN_ATOL and top1 >= FP8_MIN_TOP1, (worst, mean, top1)


def test_fp8_checkpoint_scales_load_from_lazy_slices_on_any_rank(tmp_path):
    """A rank reads its rows lazily from the safetensors file (``get_slice``), and AutoFP8 stores
    the per-tensor scales 0-dim, which the lazy reader once refused (``[:]`` on a 0-dim slice)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from sparrow.layers.linear import MergedColumnParallelLinear
    from sparrow.layers.parallel import ParallelContext
    from sparrow.quantization import quantization_scope

    gen = torch.Generator().manual_seed(2)
    parts = {name: quant_ckpt.fp8_tensors(torch.randn(32, 16, generator=gen), static=False)[0] for name in "gu"}
    save_file({f"{name}.{key}": value for name, tensors in parts.items() for key, value in tensors.items()},
              str(tmp_path / "fp8.safetensors"))
    method = Fp8Method({"quant_method": "fp8", "activation_scheme": "dynamic"})
    with quantization_scope(method):
        layer = MergedColumnParallelLinear(16, [32, 32], bias=False, tp=ParallelContext(1, 2, communicator=object()))
    with safe_open(str(tmp_path / "fp8.safetensors"), "pt") as f:
        for shard, name in enumerate("gu"):
            for key in ("weight", "weight_scale"):
                param = getattr(layer, key)
                param.weight_loader(param, f.get_slice(f"{name}.{key}"), shard)
    assert torch.equal(layer.weight_scale, torch.stack([parts[name]["weight_scale"] for name in "gu"]))
    expected = torch.cat([parts[name]["weight"][16:] for name in "gu"])  # rank 1's rows of each
    assert torch.equal(layer.weight.view(torch.uint8), expected.view(torch.uint8))


def test_fp8_quantized_on_load_matches_dequantized_weights(qwen3_dir, fp8_on_cpu, tmp_path):
    reference_dir = _requantized_copy(qwen3_dir, tmp_path / "fp8-ref",
                                      lambda w: dequantize_fp8_rows(*quantize_fp8_rows(w)))
    worst, mean, top1 = compare(teacher_forced(qwen3_dir, quantization="fp8"), teacher_forced(reference_dir))
    assert worst < FP8_ATOL and mean < FP8_MEAN_ATOL and top1 >= FP8_MIN_TOP1, (worst, mean, top1)


def _requantized_copy(model_dir: str, out: Path, round_trip) -> str:
    """``model_dir`` with every decoder linear weight replaced by ``round_trip(weight)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    state = load_file(str(out / "model.safetensors"))
    for key, tensor in state.items():
        if ".layers." in key and key.endswith("_proj.weight"):
            state[key] = round_trip(tensor)
    save_file(state, str(out / "model.safetensors"))
    return str(out)


# -- refusals at configuration time -----------------------------------------------------------------
def finalized(**kwargs):
    from sparrow.config import EngineConfig
    from sparrow.engine.setup import finalize_config

    return finalize_config(EngineConfig.from_kwargs(**{**ENGINE_ARGS, **kwargs}))


def _edited_copy(model_dir: str, out: Path, **quant_fields) -> str:
    import json
    import shutil

    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].update(quant_fields)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_a_quantized_checkpoint_selects_its_method(quant_dirs, qwen3_dir):
    awq_dir, _ = quant_dirs("awq", "awq", group_size=32)
    assert finalized(model=awq_dir).model.quantization == "awq"
    assert finalized(model=qwen3_dir).model.quantization is None
    assert finalized(model=qwen3_dir, quantization="int8").model.quantization == "int8"


def test_unsupported_combinations_fail_naming_the_field(quant_dirs, qwen3_dir, tmp_path):
    awq_dir, _ = quant_dirs("awq", "awq", group_size=32)
    gptq_dir, _ = quant_dirs("gptq-asym", "gptq", group_size=16, sym=False)
    cases = [
        (dict(model=awq_dir, quantization="int8"), r"'quantization': 'int8', but the checkpoint is already quantized "
                                                   r"with quant_method 'awq'"),
        (dict(model=qwen3_dir, quantization="awq"), r"'quantization': 'awq' loads checkpoints quantized with it"),
        (dict(model=qwen3_dir, quantization="fp8"), r"'quantization': 'fp8' has no implementation on device 'cpu' "
                                                    r"\(it runs on: cuda\)"),
        (dict(model=qwen3_dir, quantization="nope"), r"'quantization': unknown quantization method 'nope'; "
                                                     r"registered: awq, fp8, gptq, int8"),
        (dict(model=_edited_copy(gptq_dir, tmp_path / "gptq3", bits=3)), r"'quantization': 'gptq' loads 4 or 8-bit "
                                                                         r"checkpoints; this one has bits=3"),
        (dict(model=_edited_copy(awq_dir, tmp_path / "gemv", version="gemv")), r"'quantization': 'awq' loads version "
                                                                               r"'gemm' checkpoints"),
        # 2 ranks leave 32 columns of o_proj's input each: not a whole number of 64-column groups.
        (dict(model=_edited_copy(gptq_dir, tmp_path / "g64", group_size=64), tensor_parallel_size=2),
         r"'tensor_parallel_size': 2 leaves 32 of the model's attention heads x head_dim per rank"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            finalized(**kwargs)


def test_int8_weights_take_a_quarter_of_the_memory(qwen3_dir):
    with llm(qwen3_dir, quantization="int8") as engine:
        model = engine.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
        linears = [m for m in model.modules() if getattr(m, "op_name", "") == "linear"]
        assert linears and all(m.weight.dtype == torch.int8 for m in linears)
        assert all(type(m.op_impl).__name__ == "Int8Linear" for m in linears)


def test_an_act_order_gptq_checkpoint_splits_over_two_ranks(quant_dirs):
    """Two ranks (gloo): act-order row-parallel layers keep every group, column-parallel ones their
    rows; the result equals one rank's."""
    quantized_dir, _ = quant_dirs("gptq-act-order", "gptq", group_size=32, sym=True, desc_act=True)
    worst, _, top1 = compare(teacher_forced(quantized_dir, tensor_parallel_size=2), teacher_forced(quantized_dir))
    assert worst < 1e-4 and top1 == 1.0, (worst, top1)
