"""kv_cache_dtype="fp8": configuration refusals, checkpoint scales, bytes per block, and the Triton
write and attention kernels with a float8_e4m3fn cache against a reference that quantizes and
dequantizes the same keys and values in fp32.

The kernels run under Triton's CPU interpreter here (it handles float8_e4m3fn tensors) and for real
in the `cuda` tests. As in test_triton_kernels.py, TRITON_INTERPRET=1 must be set before triton is
first imported: without CUDA, and with triton not imported yet, this module sets it; otherwise one
test re-runs the interpreted tests in a subprocess.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" or (
    "triton" not in sys.modules and not torch.cuda.is_available())
if INTERPRETING:
    os.environ["TRITON_INTERPRET"] = "1"

from sparrow.config import ConfigError, EngineConfig  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
HAS_TRITON = True
try:
    import triton  # noqa: F401
except ImportError:
    HAS_TRITON = False

interpreted = pytest.mark.skipif(not (INTERPRETING and HAS_TRITON),
                                 reason="runs under the Triton interpreter (in a subprocess on GPU machines)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs an NVIDIA GPU")


# -- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["int8", "fp16", "FP8", ""])
def test_unknown_kv_cache_dtype_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match="kv_cache_dtype") as info:
        EngineConfig.from_kwargs(kv_cache_dtype=value)
    assert "auto, bfloat16, fp8, fp8_e4m3" in str(info.value)


def test_fp8_e5m2_is_refused_as_not_implemented():
    with pytest.raises(ConfigError, match="kv_cache_dtype.*fp8_e5m2 is not implemented"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8_e5m2")


def test_vllm_names_are_accepted_and_auto_is_the_default():
    assert EngineConfig.from_kwargs().cache.kv_cache_dtype == "auto"
    for value in ("auto", "fp8", "fp8_e4m3"):
        assert EngineConfig.from_kwargs(kv_cache_dtype=value).cache.kv_cache_dtype == value


def test_cli_flag():
    from sparrow.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8", "--prompt", "hi"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"


def test_cpu_platform_refuses_fp8_at_configuration_time():
    from sparrow.engine.setup import finalize_config

    with pytest.raises(ConfigError, match=r"'kv_cache_dtype'.*'fp8'.*platform 'cpu'.*supported: auto"):
        finalize_config(EngineConfig.from_kwargs(device="cpu", kv_cache_dtype="fp8"))
    # auto is what every platform supports
    assert finalize_config(EngineConfig.from_kwargs(device="cpu")).cache.kv_cache_dtype == "auto"


def test_a_requested_backend_without_fp8_is_refused_by_name(qwen3_dir):
    """A platform that stores fp8 caches, with an attention backend that cannot read them."""
    from sparrow.engine.preflight import check_platform_settings
    from sparrow.model_loader import get_hf_config
    from sparrow_cpu.platform import CpuPlatform

    class Fp8Cpu(CpuPlatform):
        supported_kv_cache_dtypes = ("auto", "fp8")

    config = EngineConfig.from_kwargs(model=qwen3_dir, kv_cache_dtype="fp8", attention_backend="torch")
    with pytest.raises(ConfigError, match=r"'kv_cache_dtype'.*attention backend 'torch'"):
        check_platform_settings(config, Fp8Cpu(), get_hf_config(qwen3_dir))


def test_cuda_runner_refuses_a_backend_without_fp8():
    from sparrow_cuda.model_runner import CudaModelRunner

    runner = object.__new__(CudaModelRunner)
    runner.model = SimpleNamespace(attn_backend=SimpleNamespace(name="plugin_attn"))
    runner.config = EngineConfig.from_kwargs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8' is not supported by attention backend 'plugin_attn'"):
        runner._use_fp8_kv_cache("fp8")


def test_old_gpus_are_refused():
    from sparrow_cuda.platform import check_fp8_kv_cache_capability

    with pytest.raises(ValueError, match=r"'fp8' needs a GPU of compute capability 8.9 or newer \(this one is 8.0\)"):
        check_fp8_kv_cache_capability("fp8", (8, 0))
    check_fp8_kv_cache_capability("fp8", (8, 9))
    check_fp8_kv_cache_capability("fp8", (9, 0))


def test_bytes_per_block_halve():
    from sparrow.core.kv_cache_utils import KVCacheGroupSpec
    from sparrow.worker.model_runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.model = SimpleNamespace(kv_cache_spec=lambda: (3, 2, 64))
    runner.kv_cache_groups = [KVCacheGroupSpec(None, (0, 1, 2))]
    runner.proposer = None  # no draft model sharing the budget
    runner.block_size = 16
    runner.kv_cache_dtype = torch.bfloat16
    bf16 = runner.kv_cache_bytes_per_block()
    assert bf16 == 2 * 3 * 16 * 2 * 64 * 2
    runner.kv_cache_dtype = FP8
    assert runner.kv_cache_bytes_per_block() * 2 == bf16


# -- checkpoint scales ----------------------------------------------------------------------------
def _write_scales(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_checkpoint_scales_are_read_per_layer(tmp_path):
    from sparrow_cuda.model_runner import apply_kv_scales, checkpoint_kv_scales

    _write_scales(tmp_path / "model.safetensors", {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(2.0, dtype=torch.bfloat16),
        "model.layers.1.self_attn.q_proj.weight": torch.zeros(2, 2),
    })
    scales = checkpoint_kv_scales(str(tmp_path))
    assert scales == {0: (0.5, 0.25), 1: (2.0, 2.0)}
    assert checkpoint_kv_scales(str(tmp_path / "absent")) == {}

    from sparrow.layers.attention import Attention
    from sparrow_cpu.attention import TorchPagedAttention  # any backend: only the layers matter

    backend = TorchPagedAttention(2, 1, 8, 8 ** -0.5, torch.float32, torch.device("cpu"))
    layers = torch.nn.ModuleList([Attention(backend, i) for i in range(3)])
    assert apply_kv_scales(layers, scales) == 2
    assert [(a.backend_kwargs["k_scale"], a.backend_kwargs["v_scale"]) for a in layers] == [
        (0.5, 0.25), (2.0, 2.0), (1.0, 1.0)]


def test_a_scale_that_is_not_per_tensor_is_refused(tmp_path):
    from sparrow_cuda.model_runner import checkpoint_kv_scales

    _write_scales(tmp_path / "model.safetensors", {"model.layers.0.self_attn.k_scale": torch.ones(4)})
    with pytest.raises(ValueError, match="not a per-tensor scale"):
        checkpoint_kv_scales(str(tmp_path))
    _write_scales(tmp_path / "model.safetensors", {"model.layers.0.self_attn.k_scale": torch.tensor(0.0)})
    with pytest.raises(ValueError, match="not a positive finite scale"):
        checkpoint_kv_scales(str(tmp_path))


def test_a_checkpoint_with_kv_scales_still_loads(qwen3_dir, tmp_path):
    """The loader skips the scale tensors (they are not parameters) instead of refusing them."""
    from sparrow.model_loader import load_model
    from sparrow_cpu.attention import TorchPagedAttention

    copy = tmp_path / "with_scales"
    shutil.copytree(qwen3_dir, copy)
    _write_scales(copy / "kv_scales.safetensors", {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                                                     "model.layers.1.self_attn.kv_scale": torch.tensor(0.7)})
    cpu = torch.device("cpu")
    plain = load_model(qwen3_dir, TorchPagedAttention, torch.float32, cpu)
    scaled = load_model(str(copy), TorchPagedAttention, torch.float32, cpu)
    for (name, a), (_, b) in zip(plain.state_dict().items(), scaled.state_dict().items()):
        assert torch.equal(a, b), name


# -- the kernels ----------------------------------------------------------------------------------
def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference quantization: x / scale saturated to e4m3's range, rounded to nearest."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.float() * scale


def reference_attention(queries, keys, values, scale) -> torch.Tensor:
    """Causal attention per request in fp32: new token j sits at position seq_len - query_len + j."""
    outs = []
    for q, k, v in zip(queries, keys, values):
        query_len, num_heads, _ = q.shape
        seq_len, num_kv_heads, _ = k.shape
        group = num_heads // num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
    return torch.cat(outs)


class Fp8Batch:
    """A mixed step over an fp8 paged cache: context quantized by the torch reference, the step's
    new tokens written by the kernel. Unowned slots hold e4m3 NaN (0x7F), so a read outside a
    request's keys turns the output into NaN."""

    def __init__(self, lens, *, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                 k_scale, v_scale, magnitude=1.0, seed=0):
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return (torch.randn(*shape, generator=gen) * magnitude).to(dtype).to(device)

        self.query_lens = [q for q, _ in lens]
        self.seq_lens = [q + c for q, c in lens]
        blocks = [math.ceil(s / block_size) for s in self.seq_lens]
        num_blocks = sum(blocks) + 3
        perm = torch.randperm(num_blocks, generator=gen)
        self.block_table = torch.zeros(len(lens), max(blocks) + 1, dtype=torch.int32)
        self.kv_cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=FP8, device=device)
        self.kv_cache.view(torch.uint8).fill_(0x7F)
        flat = self.kv_cache.view(2, -1, num_kv_heads, head_dim)
        self.keys, self.values, self.queries, slots, new_k, new_v = [], [], [], [], [], []
        used = 0
        for i, (query_len, seq_len) in enumerate(zip(self.query_lens, self.seq_lens)):
            ids = perm[used:used + blocks[i]]
            used += blocks[i]
            self.block_table[i, :len(ids)] = ids.to(torch.int32)
            pos = torch.arange(seq_len)
            req_slots = (ids[pos // block_size] * block_size + pos % block_size).to(device)
            k, v = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
            context = seq_len - query_len
            flat[0, req_slots[:context]] = quantize(k[:context], k_scale)
            flat[1, req_slots[:context]] = quantize(v[:context], v_scale)
            self.keys.append(k)
            self.values.append(v)
            self.queries.append(randn(query_len, num_heads, head_dim))
            slots.append(req_slots[context:])
            new_k.append(k[context:])
            new_v.append(v[context:])
        self.query = torch.cat(self.queries)
        self.new_keys, self.new_values = torch.cat(new_k), torch.cat(new_v)
        self.slot_mapping = torch.cat(slots).to(torch.int64)
        self.block_table = self.block_table.to(device)
        self.query_start_loc = torch.tensor([0] + self.query_lens).cumsum(0).to(torch.int32).to(device)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32, device=device)
        self.scale = head_dim ** -0.5
        self.k_scale, self.v_scale = k_scale, v_scale

    def metadata(self):
        from sparrow.attention import AttentionMetadata

        return AttentionMetadata(
            num_actual_tokens=sum(self.query_lens), num_reqs=len(self.query_lens),
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens),
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens_t, block_table=self.block_table,
            slot_mapping=self.slot_mapping, query_start_loc_cpu=self.query_start_loc.cpu(),
            seq_lens_cpu=self.seq_lens_t.cpu(), is_decode_only=max(self.query_lens) == 1)

    def cached(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per request, the keys and values quantized and dequantized in fp32 by torch; on CPU
        (the interpreter, whose fp8 rounding has a bug, see _check_write) the bytes the cache
        holds, dequantized in fp32."""
        keys = [dequantize(quantize(k, self.k_scale), self.k_scale) for k in self.keys]
        values = [dequantize(quantize(v, self.v_scale), self.v_scale) for v in self.values]
        if self.kv_cache.device.type == "cpu":
            block_size = self.kv_cache.shape[2]
            for i, seq_len in enumerate(self.seq_lens):
                pos = torch.arange(seq_len)
                blocks = self.block_table[i, pos // block_size].long()
                keys[i] = dequantize(self.kv_cache[0, blocks, pos % block_size], self.k_scale)
                values[i] = dequantize(self.kv_cache[1, blocks, pos % block_size], self.v_scale)
        return keys, values

    def reference(self) -> torch.Tensor:
        """fp32 attention over the keys and values as the cache holds them (quantized, then
        dequantized in fp32)."""
        keys, values = self.cached()
        return reference_attention(self.queries, keys, values, self.scale)


@pytest.mark.skipif(INTERPRETING or not HAS_TRITON, reason="already running under the interpreter")
def test_interpreted_kernels_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "interpreted",
         __file__], env=env, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def _rounds_up_to_a_power_of_two(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    r = rounded.float().abs()
    return (r > x.float().abs()) & (r > 0) & (torch.frexp(r).mantissa == 0.5)


def _check_write(device):
    from sparrow_cuda.triton_ops import reshape_and_cache

    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, dim = 4, 4, 2, 24
    key = (torch.randn(6, heads, dim, generator=gen) * 300).to(device)  # some values saturate
    value = torch.randn(6, heads, dim, generator=gen).to(device)
    slots = torch.tensor([5, 0, -1, 15, 9, 2], dtype=torch.int64, device=device)
    cache = torch.zeros(2, num_blocks, block_size, heads, dim, dtype=FP8, device=device)
    reshape_and_cache(key, value, cache, slots, 0.5, 0.125)
    flat = cache.view(2, -1, heads, dim)
    keep = slots >= 0
    for stored, x, scale in ((flat[0, slots[keep]], key[keep], 0.5), (flat[1, slots[keep]], value[keep], 0.125)):
        expected = quantize(x, scale)
        checked = torch.ones_like(x, dtype=torch.bool)
        if device == "cpu":
            # Triton's interpreter drops the carry when rounding up crosses a power of two
            # (127.99 -> 64 instead of 128); the GPU converts in hardware (round to nearest even).
            checked = ~_rounds_up_to_a_power_of_two(x / scale, expected)
            assert checked.float().mean() > 0.9
        assert torch.equal(stored.view(torch.uint8)[checked], expected.view(torch.uint8)[checked])
    assert flat[0, slots[keep]].float().abs().max() == FP8_MAX  # saturated, not inf/NaN
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots[keep].cpu()] = False
    assert not flat[:, untouched.to(device)].float().any()


@interpreted
def test_interpreted_write_quantizes_bit_exactly():
    _check_write("cpu")


@pytest.mark.parametrize("case", [
    # (query_len, context_len) per request, heads, kv heads, head_dim, block_size, splits, window
    ([(5, 0), (1, 13), (7, 9)], 4, 2, 32, 8, None, None),
    ([(1, 20), (1, 3)], 6, 2, 24, 4, 2, None),
    ([(9, 6), (1, 17)], 3, 3, 16, 4, None, 5),
])
@interpreted
def test_interpreted_attention_over_an_fp8_cache(case):
    lens, heads, kv_heads, dim, block_size, splits, window = case
    _check_attention("cpu", lens, heads, kv_heads, dim, block_size, splits, window, torch.float32)


def _check_attention(device, lens, heads, kv_heads, dim, block_size, splits, window, dtype):
    from sparrow_cuda.triton_ops import reshape_and_cache, unified_paged_attention

    batch = Fp8Batch(lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, block_size=block_size,
                     dtype=dtype, device=device, k_scale=0.05, v_scale=0.02, magnitude=4.0)
    reshape_and_cache(batch.new_keys, batch.new_values, batch.kv_cache, batch.slot_mapping,
                      batch.k_scale, batch.v_scale)
    out = torch.empty_like(batch.query)
    tiles = {"block_m": 16, "tile_n": 16} if device == "cpu" else {}
    unified_paged_attention(batch.query, batch.kv_cache, out, batch.query_start_loc, batch.seq_lens_t,
                            batch.block_table, batch.scale, max(lens)[0], max(batch.seq_lens),
                            sliding_window=window, k_scale=batch.k_scale, v_scale=batch.v_scale,
                            num_kv_splits=splits, **tiles)
    if window is None:
        expected = batch.reference()
    else:
        expected = _windowed_reference(batch, window)
    # fp32 queries: the kernel sees exactly the dequantized keys/values, so only summation order
    # differs (atol 2e-5); bf16 queries round q and p to bf16 (atol 2e-2).
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.to(out.device), atol=atol, rtol=1e-4 if atol < 1e-3 else 2e-2)


def _windowed_reference(batch, window):
    outs = []
    for q, k, v in zip(batch.queries, *batch.cached()):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * batch.scale
        seq_len, query_len = k.shape[0], q.shape[0]
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        hidden = (key_pos > query_pos) | (key_pos <= query_pos - window)
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


@interpreted
def test_interpreted_scales_matter():
    """The same stored bytes read with other scales give another result: the scales are applied."""
    from sparrow_cuda.triton_ops import unified_paged_attention

    batch = Fp8Batch([(3, 5)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32,
                     device="cpu", k_scale=1.0, v_scale=1.0)
    from sparrow_cuda.triton_ops import reshape_and_cache

    reshape_and_cache(batch.new_keys, batch.new_values, batch.kv_cache, batch.slot_mapping)
    run = {}
    for scales in ((1.0, 1.0), (1.0, 3.0)):
        out = torch.empty_like(batch.query)
        unified_paged_attention(batch.query, batch.kv_cache, out, batch.query_start_loc, batch.seq_lens_t,
                                batch.block_table, batch.scale, 3, 8, k_scale=scales[0], v_scale=scales[1],
                                block_m=16, tile_n=16)
        run[scales] = out
    torch.testing.assert_close(run[(1.0, 3.0)], run[(1.0, 1.0)] * 3.0, atol=1e-5, rtol=1e-5)


# -- on the GPU -----------------------------------------------------------------------------------
@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 4])
def test_gpu_triton_fp8_kernels(dtype, splits):
    _check_write("cuda")
    _check_attention("cuda", [(17, 0), (1, 40), (33, 70)], 8, 2, 128, 16, splits, None, dtype)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
def test_gpu_backend_fp8_cache(backend_name):
    if backend_name == "flashinfer":
        pytest.importorskip("flashinfer")
    from sparrow_cuda.attention import FlashInferAttentionBackend, TritonAttentionBackend

    cls = {"triton": TritonAttentionBackend, "flashinfer": FlashInferAttentionBackend}[backend_name]
    assert "fp8" in cls.supported_kv_cache_dtypes
    batch = Fp8Batch([(12, 0), (1, 30), (20, 45)], num_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                     dtype=torch.bfloat16, device="cuda", k_scale=0.05, v_scale=0.02, magnitude=4.0)
    backend = cls(8, 2, 128, batch.scale, torch.bfloat16, torch.device("cuda"))
    out = backend.forward(batch.query, batch.new_keys, batch.new_values, batch.kv_cache, batch.metadata(),
                          k_scale=batch.k_scale, v_scale=batch.v_scale)
    torch.testing.assert_close(out.float(), batch.reference(), atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_engine_fp8_kv_cache_close_to_bf16(qwen3_dir, backend):
    """Teacher-forced prompt logprobs with an fp8 cache against a bf16 cache, same model."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    from sparrow import LLM, SamplingParams

    prompt = [(7 * i + 3) % 1000 for i in range(200)]
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    results = {}
    for kv in ("auto", "fp8"):
        llm = LLM(qwen3_dir, device="cuda", multiprocess=False, dtype="bfloat16", max_model_len=512,
                  kv_cache_dtype=kv, attention_backend=backend)
        try:
            results[kv] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        finally:
            llm.shutdown()
    diffs = torch.tensor([abs(results["fp8"].prompt_logprobs[i][prompt[i]].logprob
                              - results["auto"].prompt_logprobs[i][prompt[i]].logprob)
                          for i in range(1, len(prompt))])
    assert diffs.mean() < 0.05 and diffs.max() < 0.5, (diffs.mean(), diffs.max())

