"""Sliding-window attention and logit soft-capping in every built-in attention backend path,
against a dense reference: the CPU torch backend (decode group, prefill chunks with and without
cached context), the CPU C++ decode kernel, and the Triton kernel (Triton's CPU interpreter here,
as in test_triton_kernels.py). FlashInfer needs a GPU: here only what it is asked to plan is
checked, through a stand-in for its wrappers.

Blocks wholly before a request's window are what the KV cache manager frees: here their block
table entries name a block full of NaN, so a path that reads a key it must not read turns its
output into NaN. Block 0 (where unused table tails point) holds zeros, like vLLM's null block.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" or (
    "triton" not in sys.modules and not torch.cuda.is_available())
if INTERPRETING:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (see test_triton_kernels)

from sparrow.attention import AttentionMetadata  # noqa: E402
from sparrow.layers.attention import Attention  # noqa: E402
from sparrow_cpu.attention import TorchPagedAttention  # noqa: E402
from sparrow_cpu.native import get_paged_attention  # noqa: E402


def reference(query, keys, values, scale, window, soft_cap):
    """Dense causal attention of one request: query [L, Hq, D] at the last L of the S positions of
    keys/values [S, Hkv, D], in float64."""
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


class Step:
    """One step of (query_len, context_len) requests over a shuffled paged cache, with the blocks
    wholly before each request's window freed (their entries name a NaN block)."""

    def __init__(self, lens, *, heads, kv_heads, head_dim, block_size, window, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.window, self.dtype = lens, window, dtype
        self.scale = head_dim ** -0.5
        seq_lens = [q + c for q, c in lens]
        blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = sum(blocks_needed) + 3
        poison = num_blocks - 1
        # Ids 1 .. num_blocks - 2, shuffled; block 0 is the zero "null" block, the last one poison.
        ids = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()
        self.cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        self.cache[:, poison] = float("nan")
        self.block_table = torch.zeros(len(lens), max(blocks_needed) + 2, dtype=torch.int32)
        self.keys, self.values, self.queries, slots = [], [], [], []
        for r, ((query_len, context_len), seq_len) in enumerate(zip(lens, seq_lens)):
            table = [ids.pop() for _ in range(blocks_needed[r])]
            k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
            for pos in range(context_len):
                self.cache[0, table[pos // block_size], pos % block_size] = k[pos]
                self.cache[1, table[pos // block_size], pos % block_size] = v[pos]
            slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(context_len, seq_len)]
            if window is not None:  # the first new token sees keys from context_len - window + 1 on
                for b in range(max(0, context_len - window + 1) // block_size):
                    table[b] = poison
            self.block_table[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
            self.keys.append(k)
            self.values.append(v)
            self.queries.append(torch.randn(query_len, heads, head_dim, generator=gen).to(dtype) * 3)
        self.query = torch.cat(self.queries)
        self.new_keys = torch.cat([k[c:] for k, (_, c) in zip(self.keys, lens)])
        self.new_values = torch.cat([v[c:] for v, (_, c) in zip(self.values, lens)])
        query_start_loc = torch.tensor([0] + [q for q, _ in lens]).cumsum(0).to(torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        self.metadata = AttentionMetadata(
            num_actual_tokens=len(self.query), num_reqs=len(lens), max_query_len=max(q for q, _ in lens),
            max_seq_len=max(seq_lens), query_start_loc=query_start_loc, seq_lens=seq_lens_t,
            block_table=self.block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens_t,
            is_decode_only=all(q == 1 for q, _ in lens))

    def expected(self, soft_cap):
        return torch.cat([reference(q, k, v, self.scale, self.window, soft_cap)
                          for q, k, v in zip(self.queries, self.keys, self.values)])

    def run(self, backend, soft_cap):
        layer = Attention(backend, 0, sliding_window=self.window, logits_soft_cap=soft_cap)
        backend.prepare(self.metadata)
        return layer(self.query, self.new_keys, self.new_values, self.cache, self.metadata)


# (query_len, context_len), window 12, block 4: decodes far past the window, inside it and at
# position 0; a prefill longer than the window with no context; chunks after a context longer
# than the window (block-aligned and not) and one shorter than it; a prefill inside the window.
MIXED = [(1, 40), (1, 7), (1, 0), (30, 0), (9, 27), (5, 30), (6, 5), (8, 0), (1, 13)]
DECODES = [(1, 40), (1, 7), (1, 0), (1, 29), (1, 12)]
WINDOW = 12


def cpu_backend(native: bool, heads=6, kv_heads=2, head_dim=16, dtype=torch.float32) -> TorchPagedAttention:
    if native and get_paged_attention() is None:
        pytest.skip("no compiler for the C++ kernel")
    backend = TorchPagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, dtype, torch.device("cpu"))
    if not native:
        backend.native_paged_attention = None
    return backend


@pytest.mark.parametrize("native", [False, True], ids=["torch", "cpp-decode"])
@pytest.mark.parametrize("window,soft_cap", [(WINDOW, None), (None, 5.0), (WINDOW, 5.0)])
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64 and 128: the C++ kernel's compiled head sizes
def test_cpu_backend_against_dense_reference(native, window, soft_cap, lens, head_dim):
    step = Step(lens, heads=6, kv_heads=2, head_dim=head_dim, block_size=4, window=window)
    out = step.run(cpu_backend(native, head_dim=head_dim), soft_cap)
    torch.testing.assert_close(out.double(), step.expected(soft_cap), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "cpp-decode"])
def test_cpu_backend_bfloat16_with_head_dim_64(native):
    step = Step(MIXED, heads=4, kv_heads=1, head_dim=64, block_size=16, window=WINDOW, dtype=torch.bfloat16,
                seed=1)
    out = step.run(cpu_backend(native, heads=4, kv_heads=1, head_dim=64, dtype=torch.bfloat16), 20.0)
    torch.testing.assert_close(out.double(), step.expected(20.0), atol=3e-2, rtol=3e-2)


def test_layers_of_several_windows_share_one_step_plan():
    """Gemma-style: sliding and global layers (and two windows) run in one step, in any order."""
    step = Step(MIXED, heads=6, kv_heads=2, head_dim=16, block_size=4, window=None, seed=2)
    backend = cpu_backend(False)
    backend.prepare(step.metadata)
    for window in (WINDOW, None, 5, WINDOW):
        layer = Attention(backend, 0, sliding_window=window)
        out = layer(step.query, step.new_keys, step.new_values, step.cache, step.metadata)
        step.window = window
        torch.testing.assert_close(out.double(), step.expected(None), atol=2e-5, rtol=2e-5)


def test_backend_without_the_features_is_refused_by_name():
    class Plain(TorchPagedAttention):
        name = "plain"
        supports_sliding_window = supports_logits_soft_cap = False

    backend = Plain(4, 2, 16, 0.25, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="'plain' does not support sliding_window"):
        Attention(backend, 3, sliding_window=8)
    with pytest.raises(ValueError, match="does not support logits_soft_cap"):
        Attention(backend, 3, logits_soft_cap=30.0)


def test_every_builtin_backend_declares_both_features():
    from sparrow_cuda.attention import FlashInferAttentionBackend, TritonAttentionBackend

    for cls in (TorchPagedAttention, TritonAttentionBackend, FlashInferAttentionBackend):
        assert cls.supports_sliding_window and cls.supports_logits_soft_cap, cls.name


# -- Triton (interpreted on CPU) ---------------------------------------------------------------

def _triton_interpreter_usable() -> bool:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return False

    @triton.jit
    def loop_kernel(out_ptr, n):
        total = n * 0
        for _ in range(0, tl.load(out_ptr) + n):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        loop_kernel[(1,)](out, 3)
    except Exception:  # noqa: BLE001 - an old interpreter under a new numpy
        return False
    return int(out) == 3


interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")


@pytest.mark.skipif(INTERPRETING, reason="already running under the interpreter")
def test_triton_cases_in_an_interpreter_subprocess():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "triton_", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def _triton_backend(heads=6, kv_heads=2, head_dim=16):
    if not _triton_interpreter_usable():
        pytest.skip("this triton's interpreter cannot run these kernels")
    from sparrow_cuda.attention import TritonAttentionBackend

    return TritonAttentionBackend(heads, kv_heads, head_dim, head_dim ** -0.5, torch.float32,
                                  torch.device("cpu"))


@interpreted
@pytest.mark.parametrize("window,soft_cap", [(WINDOW, None), (WINDOW, 5.0), (None, 5.0)])
def test_triton_backend_against_dense_reference(window, soft_cap):
    step = Step(MIXED, heads=6, kv_heads=2, head_dim=16, block_size=4, window=window, seed=3)
    out = step.run(_triton_backend(), soft_cap)
    torch.testing.assert_close(out.double(), step.expected(soft_cap), atol=2e-5, rtol=2e-5)


@interpreted
@pytest.mark.parametrize("num_kv_splits,block_m,tile_n", [(1, 16, 16), (4, 16, 16), (2, 32, 8)])
def test_triton_kernel_tiles_and_splits_with_a_window(num_kv_splits, block_m, tile_n):
    """Small tiles put the window's start inside tiles, across splits and inside query tiles."""
    from sparrow_cuda.triton_ops import reshape_and_cache, unified_paged_attention

    if not _triton_interpreter_usable():
        pytest.skip("this triton's interpreter cannot run these kernels")
    lens = [(1, 70), (20, 33), (1, 3), (17, 0)]
    step = Step(lens, heads=4, kv_heads=2, head_dim=16, block_size=8, window=10, seed=4)
    reshape_and_cache(step.new_keys, step.new_values, step.cache, step.metadata.slot_mapping)
    out = torch.full_like(step.query, 7.0)
    md = step.metadata
    unified_paged_attention(step.query, step.cache, out, md.query_start_loc, md.seq_lens, md.block_table,
                            step.scale, md.max_query_len, md.max_seq_len, sliding_window=10, logits_soft_cap=8.0,
                            num_kv_splits=num_kv_splits, block_m=block_m, tile_n=tile_n)
    torch.testing.assert_close(out.double(), step.expected(8.0), atol=2e-5, rtol=2e-5)


@interpreted
def test_triton_kernel_refuses_bad_window_and_cap():
    from sparrow_cuda.triton_ops import unified_paged_attention

    step = Step([(1, 3)], heads=2, kv_heads=1, head_dim=16, block_size=4, window=None)
    md = step.metadata
    args = (step.query, step.cache, torch.empty_like(step.query), md.query_start_loc, md.seq_lens,
            md.block_table, step.scale, 1, 4)
    with pytest.raises(ValueError, match="sliding_window"):
        unified_paged_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        unified_paged_attention(*args, logits_soft_cap=-1.0)


# -- FlashInfer (no GPU here): what it is asked to plan -----------------------------------------

class _FakeWrapper:
    """Stands in for a FlashInfer wrapper: records each plan() and run()."""

    def __init__(self, workspace, layout, **kwargs):
        self.plans, self.runs = [], 0

    def plan(self, *args, **kwargs):
        self.plans.append(kwargs)
        self.plan_args = args

    def run(self, query, kv_cache, out):
        self.runs += 1
        out.zero_()


def test_flashinfer_plans_one_wrapper_per_window_and_soft_cap(monkeypatch):
    import types

    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper,
                                 BatchDecodeWithPagedKVCacheWrapper=_FakeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from sparrow_cuda.attention import FlashInferAttentionBackend

    backend = FlashInferAttentionBackend(6, 2, 16, 0.25, torch.float32, torch.device("cpu"), block_size=4,
                                         workspace_bytes=16)
    backend._ops = types.SimpleNamespace(reshape_and_cache=lambda *args: None)  # a Triton kernel
    layers = [Attention(backend, 0, sliding_window=WINDOW, logits_soft_cap=5.0), Attention(backend, 1),
              Attention(backend, 2, sliding_window=WINDOW, logits_soft_cap=5.0)]
    for lens in (MIXED, DECODES, MIXED):  # a new step plans again
        step = Step(lens, heads=6, kv_heads=2, head_dim=16, block_size=4, window=None)
        backend.prepare(step.metadata)
        for layer in layers:
            layer(step.query, step.new_keys, step.new_values, step.cache, step.metadata)
    windowed_prefill, windowed_decode = backend._wrappers[(0, WINDOW, 5.0)]
    plain_prefill, plain_decode = backend._wrappers[(0, None, None)]
    assert [(p["window_left"], p["logits_soft_cap"]) for p in windowed_prefill.plans] == [(WINDOW - 1, 5.0)] * 2
    plain = [(p["window_left"], p["logits_soft_cap"], p["causal"]) for p in plain_prefill.plans]
    assert plain == [(-1, None, True)] * 2
    assert [(p["window_left"], p["logits_soft_cap"]) for p in windowed_decode.plans] == [(WINDOW - 1, 5.0)]
    assert len(plain_decode.plans) == 1 and windowed_prefill.runs == 4 and plain_prefill.runs == 2


def test_flashinfer_plans_each_kv_cache_group_on_its_own_wrappers(monkeypatch):
    # A hybrid cache: two groups of sliding layers with the same window but their own block
    # tables. Planning the second group must not replace the first group's plan.
    import dataclasses
    import types

    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper,
                                 BatchDecodeWithPagedKVCacheWrapper=_FakeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from sparrow_cuda.attention import FlashInferAttentionBackend

    backend = FlashInferAttentionBackend(6, 2, 16, 0.25, torch.float32, torch.device("cpu"), block_size=4,
                                         workspace_bytes=16)
    backend._ops = types.SimpleNamespace(reshape_and_cache=lambda *args: None)
    layers = [Attention(backend, index, sliding_window=WINDOW) for index in range(4)]
    for index, layer in enumerate(layers):
        layer.kv_group = index % 2
    step = Step(MIXED, heads=6, kv_heads=2, head_dim=16, block_size=4, window=None)
    metadata = step.metadata
    other_table = metadata.block_table.flip(-1).contiguous()  # the second group's own block ids
    metadata.groups = [metadata, dataclasses.replace(metadata, block_table=other_table, kv_group=1)]
    for group_metadata in metadata.groups:
        backend.prepare(group_metadata)
    for layer in layers:
        layer(step.query, step.new_keys, step.new_values, step.cache, metadata)
    first, _ = backend._wrappers[(0, WINDOW, None)]
    second, _ = backend._wrappers[(1, WINDOW, None)]
    assert first is not second and len(first.plans) == len(second.plans) == 1
    assert first.runs == second.runs == 2
    # Each wrapper was planned with its own group's pages (kv_indices, the plan's third argument).
    assert not torch.equal(first.plan_args[2], second.plan_args[2])
