"""The C++ paged decode-attention kernel's compile-time specializations against plain fp32 math.

The kernel has separate code for head sizes 64 and 128 (others take a generic path, with a scalar
tail for a size that is no multiple of the SIMD width), for tiles of 4, 2 and 1 query heads per KV
head (a group of 3 or 7 takes a mix), for one row (its KV heads split across items) and for many
rows (one item per row), and for rows of a chunk that start inside a block or end in one.
"""

from __future__ import annotations

import pytest
import torch

from sparrow_cpu.native import get_paged_attention

kernel = get_paged_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no compiler for the C++ kernel")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def make_batch(seed, query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, cache_dtype):
    """Requests with their blocks scattered through a cache of random (never zero) keys/values."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_request) + 1  # a spare column: the walk must stop at the context
    num_blocks = sum(blocks_per_request) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max_blocks), num_blocks - 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_request):
        table[i, :n] = order[used: used + n].to(torch.int32)
        used += n
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    rows = torch.arange(starts[-1])
    row_req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    return (query, cache, rows, row_req, torch.tensor(starts, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), table)


def reference(query, cache, rows, row_req, starts, seq_lens, table, scale, window, soft_cap):
    """softmax(q k^T * scale) v per row in float64, from the blocks the row's request holds."""
    _, _, block_size, kv_heads, head_dim = cache.shape
    group = query.shape[1] // kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    for t, r in zip(rows.tolist(), row_req.tolist()):
        query_len = int(starts[r + 1] - starts[r])
        position = int(seq_lens[r]) - query_len + (t - int(starts[r]))
        blocks = table[r, : position // block_size + 1].long()
        keys = cache[0, blocks].reshape(-1, kv_heads, head_dim)[: position + 1].double()
        values = cache[1, blocks].reshape(-1, kv_heads, head_dim)[: position + 1].double()
        first = max(0, position - window + 1) if window > 0 else 0
        keys = keys[first:].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values[first:].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", query[t].double(), keys) * scale
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), values)
    return out


def check(batch, window=0, soft_cap=0.0):
    query, cache, rows, row_req, starts, seq_lens, table = batch
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))
    kernel(query, cache, out, rows, row_req, starts, seq_lens, table, scale, window, soft_cap)
    expected = reference(*batch, scale, window, soft_cap)
    if query.dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=2e-5)


GROUPS = [(4, 4), (8, 4), (12, 3), (32, 4), (6, 2), (14, 2)]  # query heads per KV head: 1, 2, 4, 8, 3, 7


@pytest.mark.parametrize("head_dim", [64, 128, 80, 72])
@pytest.mark.parametrize("heads,kv_heads", GROUPS)
@pytest.mark.parametrize("num_rows", [1, 11])
def test_every_head_size_and_group(threads, head_dim, heads, kv_heads, num_rows):
    seq_lens = [37 + 29 * i for i in range(num_rows)]  # no multiples of the block size
    batch = make_batch(head_dim + heads + num_rows, [1] * num_rows, seq_lens, heads, kv_heads, head_dim,
                       16, torch.float32, torch.float32)
    check(batch)


@pytest.mark.parametrize("block_size", [4, 16, 24, 32])
@pytest.mark.parametrize("num_rows", [1, 9])
def test_block_sizes_around_the_simd_width(threads, block_size, num_rows):
    seq_lens = [1 + 13 * i for i in range(num_rows)]
    batch = make_batch(block_size, [1] * num_rows, seq_lens, 8, 4, 64, block_size, torch.float32, torch.float32)
    check(batch)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("num_rows", [1, 10])
def test_bfloat16_cache(threads, head_dim, dtype, cache_dtype, num_rows):
    seq_lens = [50 + 31 * i for i in range(num_rows)]
    batch = make_batch(7 + num_rows, [1] * num_rows, seq_lens, 8, 2, head_dim, 16, dtype, cache_dtype)
    check(batch)


@pytest.mark.parametrize("window", [1, 5, 16, 21, 100])
@pytest.mark.parametrize("soft_cap", [0.0, 2.5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (32, 4, 128), (6, 2, 72)])
@pytest.mark.parametrize("num_rows", [2, 12])
def test_window_and_soft_cap(threads, window, soft_cap, heads, kv_heads, head_dim, num_rows):
    seq_lens = [40 + 23 * i for i in range(num_rows)]
    batch = make_batch(window + num_rows, [1] * num_rows, seq_lens, heads, kv_heads, head_dim, 16,
                       torch.float32, torch.float32)
    check(batch, window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("window", [0, 7])
def test_prefill_chunk_rows_and_a_subset_of_rows(threads, window):
    # decode (context 45), a 9-token chunk after 20 cached, a 4-token first chunk, decode at 1;
    # the kernel computes only the rows it is given
    query_lens, seq_lens = [1, 9, 4, 1], [45, 29, 4, 1]
    batch = make_batch(window, query_lens, seq_lens, 16, 4, 64, 16, torch.float32, torch.float32)
    query, cache, rows, row_req, starts, lens, table = batch
    keep = torch.tensor([0, 2, 3, 5, 9, 10, 13, 14])
    subset = (query, cache, rows[keep], row_req[keep], starts, lens, table)
    scale = 0.125
    out = torch.zeros_like(query)
    kernel(query, cache, out, rows[keep], row_req[keep], starts, lens, table, scale, window, 0.0)
    expected = reference(*subset, scale, window, 0.0)
    torch.testing.assert_close(out.double()[keep], expected[keep], rtol=1e-4, atol=2e-5)
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[keep] = False
    assert (out[others] == 0).all()


def test_large_scores_keep_the_softmax_exact(threads):
    # scores far apart (up to hundreds): the reference max must move, and the output is the value
    # row of the largest score
    batch = make_batch(3, [1] * 9, [70] * 9, 8, 4, 64, 16, torch.float32, torch.float32)
    query = batch[0] * 30
    check((query, *batch[1:]))
