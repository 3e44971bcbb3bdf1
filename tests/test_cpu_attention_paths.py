"""The CPU backend's two decode paths (C++ kernel, plain torch) against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from sparrow.attention import AttentionMetadata
from sparrow_cpu.attention import TorchPagedAttention
from sparrow_cpu.native import get_paged_attention


def reference(query, keys, values, scale):
    # query [Hq, D]; keys/values [S, Hkv, D] -> [Hq, D]
    group = query.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    weights = torch.softmax((query.unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)  # [Hq, S]
    return (weights.unsqueeze(1) @ v).squeeze(1)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128 have their own compiled kernels
def test_mixed_decode_and_prefill_batch(native, dtype, head_dim):
    if native and get_paged_attention() is None:
        pytest.skip("no compiler for the C++ kernel")
    torch.manual_seed(0)
    heads, kv_heads, block_size, num_blocks = 8, 2, 4, 64
    scale = 1 / math.sqrt(head_dim)
    backend = TorchPagedAttention(heads, kv_heads, head_dim, scale, dtype, torch.device("cpu"))
    if not native:
        backend.native_paged_attention = None
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    # request 0: decode at context 9; request 1: 5-token chunk after 6 cached; request 2: decode at 1
    query_lens, seq_lens = [1, 5, 1], [10, 11, 1]
    tables = [torch.randperm(num_blocks)[:4].tolist() for _ in query_lens]
    history = [torch.randn(n, kv_heads, head_dim, dtype=dtype) for n in seq_lens]  # every key of each request
    values = [torch.randn(n, kv_heads, head_dim, dtype=dtype) for n in seq_lens]
    for r, (n_seq, n_new) in enumerate(zip(seq_lens, query_lens)):  # cached context
        for pos in range(n_seq - n_new):
            block, offset = tables[r][pos // block_size], pos % block_size
            cache[0, block, offset], cache[1, block, offset] = history[r][pos], values[r][pos]
    new_keys = torch.cat([history[r][s - q:] for r, (s, q) in enumerate(zip(seq_lens, query_lens))])
    new_values = torch.cat([values[r][s - q:] for r, (s, q) in enumerate(zip(seq_lens, query_lens))])
    slots = [tables[r][pos // block_size] * block_size + pos % block_size
             for r, (s, q) in enumerate(zip(seq_lens, query_lens)) for pos in range(s - q, s)]
    query = torch.randn(sum(query_lens), heads, head_dim, dtype=dtype)
    qsl = torch.tensor([0, 1, 6, 7], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=7, num_reqs=3, max_query_len=5, max_seq_len=11, query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32))
    backend.prepare(metadata)
    out = backend.forward(query, new_keys, new_values, cache, metadata)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    row = 0
    for r, (s, q) in enumerate(zip(seq_lens, query_lens)):
        for j in range(q):
            position = s - q + j
            expected = reference(query[row].float(), history[r][: position + 1].float(),
                                 values[r][: position + 1].float(), scale)
            assert torch.allclose(out[row].float(), expected, atol=tolerance, rtol=tolerance), (r, j)
            row += 1
