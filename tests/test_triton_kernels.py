"""The Triton paged-KV kernels against a plain torch reference, run by Triton's CPU interpreter.

Triton decides whether kernels are interpreted when they are decorated, its own ``tl`` helpers
included, so TRITON_INTERPRET=1 must be set before triton is first imported. On a machine without
CUDA where nothing imported triton yet, this module sets it and runs in-process. Otherwise (a GPU
machine, whose real kernels other tests need, or triton already imported) one test re-runs this
file in a subprocess with the variable set. Sizes and tiles are tiny: the interpreter executes
every program in numpy.
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
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from sparrow.attention import AttentionMetadata  # noqa: E402
from sparrow_cuda.attention import TritonAttentionBackend  # noqa: E402


def _interpreter_runs_dynamic_loops() -> bool:
    """Older interpreters (e.g. triton 3.6) turn scalars into 1-element arrays that numpy >= 2.4
    refuses to convert to int, so any loop with a runtime bound fails there."""
    import triton
    import triton.language as tl

    @triton.jit
    def count_kernel(out_ptr, n):
        total = n * 0
        for _ in range(0, tl.load(out_ptr) + n):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count_kernel[(1,)](out, 3)
    except Exception:  # noqa: BLE001 - any failure means "cannot run these tests here"
        return False
    return int(out) == 3


if INTERPRETING:
    if not _interpreter_runs_dynamic_loops():
        pytest.skip("this triton's interpreter cannot run loops with runtime bounds under this "
                    "numpy (fixed in newer triton)", allow_module_level=True)
    from sparrow_cuda.triton_ops import reshape_and_cache, unified_paged_attention

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")


@pytest.mark.skipif(INTERPRETING, reason="already running under the interpreter")
def test_interpreted_kernels_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:  # 5: all skipped
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


# Small tiles keep the interpreter quick (every program is executed in numpy).
TINY_TILES = {"block_m": 16, "tile_n": 16}


def reference_attention(
    queries: list[torch.Tensor],  # per request [query_len, num_heads, head_dim]
    keys: list[torch.Tensor],  # per request [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor],  # per request [seq_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [sum query_len, num_heads, head_dim], fp32
    """Causal attention per request: new token j sits at position seq_len - query_len + j."""
    outs = []
    for q, k, v in zip(queries, keys, values):
        query_len, num_heads, _ = q.shape
        seq_len, num_kv_heads, _ = k.shape
        group = num_heads // num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [heads, query_len, seq_len]
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
    return torch.cat(outs)


class Batch:
    """A random step: cached context + new tokens per request, scattered over a paged cache.

    The cache starts as NaN everywhere, so a kernel that reads a slot it must not read (an unused
    block, the unwritten tail of the last block) turns its output into NaN.
    """

    def __init__(self, query_and_context_lens, *, num_heads, num_kv_heads, head_dim, block_size,
                 dtype, num_padding_tokens=0, seed=0):
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        self.query_lens = [q for q, _ in query_and_context_lens]
        self.seq_lens = [q + c for q, c in query_and_context_lens]
        num_reqs = len(self.seq_lens)
        blocks_needed = [math.ceil(s / block_size) for s in self.seq_lens]
        max_blocks = max(blocks_needed) + 2  # unused tail entries stay 0
        num_blocks = sum(blocks_needed) + 5  # spare blocks that nobody owns
        # Shuffled physical ids: block tables are non-contiguous and skip some blocks entirely.
        perm = torch.randperm(num_blocks, generator=gen)
        self.block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
        self.kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim),
                                   float("nan"), dtype=dtype)
        self.keys, self.values, self.queries, slots = [], [], [], []
        used = 0
        for i, (query_len, seq_len) in enumerate(zip(self.query_lens, self.seq_lens)):
            ids = perm[used:used + blocks_needed[i]]
            used += blocks_needed[i]
            self.block_table[i, :len(ids)] = ids.to(torch.int32)
            pos = torch.arange(seq_len)
            req_slots = ids[pos // block_size] * block_size + pos % block_size  # [seq_len]
            k = randn(seq_len, num_kv_heads, head_dim)
            v = randn(seq_len, num_kv_heads, head_dim)
            context_len = seq_len - query_len
            # Cached context is written directly; new tokens go through reshape_and_cache.
            flat = self.kv_cache.view(2, -1, num_kv_heads, head_dim)
            flat[0, req_slots[:context_len]] = k[:context_len]
            flat[1, req_slots[:context_len]] = v[:context_len]
            self.keys.append(k)
            self.values.append(v)
            self.queries.append(randn(query_len, num_heads, head_dim))
            slots.append(req_slots[context_len:])
        self.num_actual_tokens = sum(self.query_lens)
        pad_rows = num_padding_tokens
        self.query = torch.cat(self.queries + [randn(pad_rows, num_heads, head_dim)])
        self.new_keys = torch.cat([k[s - q:] for k, q, s in
                                   zip(self.keys, self.query_lens, self.seq_lens)]
                                  + [randn(pad_rows, num_kv_heads, head_dim)])
        self.new_values = torch.cat([v[s - q:] for v, q, s in
                                     zip(self.values, self.query_lens, self.seq_lens)]
                                    + [randn(pad_rows, num_kv_heads, head_dim)])
        self.slot_mapping = torch.cat(slots + [torch.full((pad_rows,), -1)]).to(torch.int64)
        self.query_start_loc = torch.tensor([0] + self.query_lens, dtype=torch.int32).cumsum(
            0, dtype=torch.int32)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32)
        self.scale = head_dim ** -0.5

    def reference(self) -> torch.Tensor:
        return reference_attention(self.queries, self.keys, self.values, self.scale)

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=self.num_actual_tokens, num_reqs=len(self.seq_lens),
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens),
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens_t,
            block_table=self.block_table, slot_mapping=self.slot_mapping,
            query_start_loc_cpu=self.query_start_loc, seq_lens_cpu=self.seq_lens_t,
            is_decode_only=all(q == 1 for q in self.query_lens))

    def run(self, **kwargs) -> torch.Tensor:
        reshape_and_cache(self.new_keys, self.new_values, self.kv_cache, self.slot_mapping)
        out = torch.full_like(self.query, 7.0)
        unified_paged_attention(
            self.query, self.kv_cache, out, self.query_start_loc, self.seq_lens_t,
            self.block_table, self.scale, max(self.query_lens), max(self.seq_lens), **kwargs)
        return out


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


# (query_len, context_len): a fresh prefill, a chunk after a block-aligned prefix-cache hit, a
# chunk after an unaligned context, decodes (one with no context) and a two-token chunk.
MIXED = [(21, 0), (13, 32), (7, 21), (1, 40), (1, 0), (1, 17), (2, 30)]


@interpreted
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block_size,dtype", [
    (64, 2, 2, 16, torch.float32),
    (128, 4, 2, 32, torch.float32),
    (64, 8, 2, 16, torch.float32),
    (128, 4, 1, 16, torch.float16),
    (64, 4, 2, 32, torch.bfloat16),
])
def test_mixed_batch(head_dim, num_heads, num_kv_heads, block_size, dtype):
    batch = Batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  block_size=block_size, dtype=dtype, num_padding_tokens=3)
    out = batch.run(**TINY_TILES)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n].float(), batch.reference(), **tolerance(dtype))
    assert torch.all(out[n:] == 7.0), "padding rows must be left untouched"


@pytest.mark.parametrize("num_kv_splits", [1, 4])
@interpreted
def test_decode_batch(num_kv_splits):
    lens = [(1, 70), (1, 5), (1, 33), (1, 0)]
    batch = Batch(lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype=torch.float32, seed=1)
    out = batch.run(num_kv_splits=num_kv_splits, tile_n=16)
    torch.testing.assert_close(out, batch.reference(), atol=1e-4, rtol=1e-4)


@interpreted
def test_split_kv_with_multi_token_tiles():
    # 32-token query tiles over 16-key tiles: a later segment holds keys that the tile's early
    # tokens must not see, so their online softmax starts from an all-masked tile.
    batch = Batch([(30, 0), (20, 40), (3, 0), (1, 50)], num_heads=1, num_kv_heads=1, head_dim=64,
                  block_size=16, dtype=torch.float32, seed=2)
    out = batch.run(num_kv_splits=4, block_m=32, tile_n=16)
    torch.testing.assert_close(out, batch.reference(), atol=1e-4, rtol=1e-4)


@interpreted
def test_padded_group_and_head_dim():
    # GQA group of 3 (padded to 4 rows) and head_dim 48 (padded to 64).
    batch = Batch([(5, 11), (1, 20)], num_heads=6, num_kv_heads=2, head_dim=48, block_size=16,
                  dtype=torch.float32, seed=3)
    out = batch.run(**TINY_TILES)
    torch.testing.assert_close(out, batch.reference(), atol=1e-4, rtol=1e-4)


@interpreted
def test_reshape_and_cache_strided_input_and_padding():
    num_kv_heads, head_dim, block_size, num_blocks = 2, 64, 16, 6
    gen = torch.Generator().manual_seed(4)
    # key/value as views into a fused qkv projection: row stride larger than heads * head_dim.
    qkv = torch.randn(5, 4 + 2 * num_kv_heads, head_dim, generator=gen)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slot_mapping = torch.tensor([37, 0, -1, 95, -1], dtype=torch.int64)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), -3.0)
    expected = kv_cache.clone()
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[token]
            expected[1, slot // block_size, slot % block_size] = value[token]
    reshape_and_cache(key, value, kv_cache, slot_mapping)
    assert torch.equal(kv_cache, expected)


@interpreted
def test_triton_backend_forward():
    # The backend end to end with its default (large) tiles: write new K/V, then attend.
    batch = Batch([(6, 10), (1, 16), (3, 0)], num_heads=4, num_kv_heads=2, head_dim=64,
                  block_size=16, dtype=torch.float32, seed=5)
    backend = TritonAttentionBackend(4, 2, 64, batch.scale, torch.float32, torch.device("cpu"))
    metadata = batch.metadata()
    backend.prepare(metadata)
    out = backend.forward(batch.query, batch.new_keys, batch.new_values, batch.kv_cache, metadata)
    assert out.shape == batch.query.shape
    torch.testing.assert_close(out, batch.reference(), atol=1e-4, rtol=1e-4)


# -- a step padded as a CUDA graph replays it (sparrow_cuda.cuda_graphs) -------------------------

@interpreted
@pytest.mark.parametrize("family,lens,num_kv_splits", [
    ("decode", [(1, 40), (1, 5), (1, 0)], 1),
    ("decode", [(1, 40), (1, 5), (1, 0)], 4),
    ("verify", [(3, 30), (1, 17), (3, 0)], 2),  # k = 2: one request drafted nothing
    ("mixed", MIXED, 1),
])
def test_graph_padding_leaves_the_real_rows_and_the_cache_alone(family, lens, num_kv_splits):
    """The step written into a graph's static buffers (empty padding requests, slot -1 padding
    tokens, the attention told the captured shape's max_query_len) attends exactly as itself:
    real rows match the reference, and nothing reads a slot it must not (the cache is NaN where
    unwritten, so a stray read shows as NaN) or writes a padding token."""
    from sparrow_cuda.cuda_graphs import GraphShape, StaticInputs

    batch = Batch(lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=6)
    t, r = batch.num_actual_tokens, len(lens)
    query_len = {"decode": 1, "verify": 3, "mixed": 64}[family]
    shape = GraphShape(family, max(2 * t, 8) if family == "mixed" else 2 * r * query_len, 2 * r, query_len, False)
    static = StaticInputs(shape.num_tokens, shape.num_reqs,
                          torch.zeros(shape.num_reqs, batch.block_table.shape[1], dtype=torch.int32),
                          torch.device("cpu"), lora=False)
    static.block_table[r:] = batch.block_table[0]  # stale rows of other requests: never read
    static.clear()
    metadata = static.metadata(shape, max_seq_len=256)
    ids = torch.arange(t)
    static.fill(shape, ids, ids, batch.metadata(), None)
    padding = shape.num_tokens - t
    gen = torch.Generator().manual_seed(7)
    query = torch.cat([batch.query, torch.randn(padding, 4, 64, generator=gen)])
    new_keys = torch.cat([batch.new_keys, torch.randn(padding, 2, 64, generator=gen)])
    new_values = torch.cat([batch.new_values, torch.randn(padding, 2, 64, generator=gen)])
    cache_before = batch.kv_cache.clone()
    reshape_and_cache(new_keys, new_values, batch.kv_cache, metadata.slot_mapping)
    written = batch.kv_cache.clone()
    batch.kv_cache.copy_(cache_before)
    reshape_and_cache(batch.new_keys, batch.new_values, batch.kv_cache, batch.slot_mapping)
    assert torch.equal(written.nan_to_num(1234.5), batch.kv_cache.nan_to_num(1234.5)), "a padding token wrote"
    out = torch.full_like(query, 7.0)
    unified_paged_attention(query, batch.kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                            metadata.block_table, batch.scale, metadata.max_query_len, metadata.max_seq_len,
                            num_kv_splits=num_kv_splits, tile_n=16)
    torch.testing.assert_close(out[:t], batch.reference(), atol=1e-4, rtol=1e-4)
    assert torch.all(out[t:] == 7.0), "padding rows must be left untouched"
    assert torch.equal(metadata.query_start_loc[r + 1:], torch.full((shape.num_reqs - r,), t, dtype=torch.int32))
    assert torch.all(metadata.seq_lens[r:] == 0) and torch.all(metadata.slot_mapping[t:] == -1)
