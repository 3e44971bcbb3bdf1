"""The CPU plugin's C++ element-wise kernels and packed linears against the torch layers."""

from __future__ import annotations

import pytest
import torch

from sparrow.layers.activation import SiluAndMul
from sparrow.layers.layernorm import RMSNorm
from sparrow.layers.linear import ColumnParallelLinear, RowParallelLinear
from sparrow.layers.rotary import RotaryEmbedding, default_inv_freq
from sparrow_cpu.fused import install_fused_ops
from sparrow_cpu.gemm import OneDnnLinear, pack_linear_weights, packed_linear_available
from sparrow_cpu.native import get_elementwise_ops

needs_kernels = pytest.mark.skipif(get_elementwise_ops() is None, reason="no compiler for the C++ kernels")


def _installed(layer: torch.nn.Module) -> torch.nn.Module:
    assert install_fused_ops(layer, torch.float32) == 1
    assert layer.platform_forward is not None
    return layer


def _norm(hidden: int) -> RMSNorm:
    layer = RMSNorm(hidden, eps=1e-5)
    layer.weight.data.normal_(1.0, 0.2)
    return layer


@needs_kernels
@pytest.mark.parametrize("hidden", [8, 64, 72, 512])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_and_fused_add(hidden, rows):
    torch.manual_seed(hidden + rows)
    layer = _norm(hidden)
    x, residual = torch.randn(rows, hidden) * 3, torch.randn(rows, hidden)
    expected = layer.forward_native(x)
    expected_norm, expected_sum = layer.forward_native(x, residual)
    native = _installed(layer)
    torch.testing.assert_close(native(x), expected, rtol=1e-5, atol=1e-5)
    got_norm, got_sum = native(x.clone(), residual.clone())
    torch.testing.assert_close(got_sum, expected_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_norm, expected_norm, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_rms_norm_on_strided_heads():
    # q/k norm: the heads of a fused QKV output, a view with a row stride wider than the heads
    torch.manual_seed(0)
    layer = _norm(16)
    qkv = torch.randn(7, (4 + 2 + 2) * 16)
    q = qkv[:, : 4 * 16].view(7, 4, 16)
    k = qkv[:, 4 * 16: 6 * 16].view(7, 2, 16)
    expected_q, expected_k = layer.forward_native(q), layer.forward_native(k)
    native = _installed(layer)
    torch.testing.assert_close(native(q), expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native(k), expected_k, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (32, 16), (128, 128)])
def test_rotary_matches_torch_in_place_on_qkv_views(head_dim, rotary_dim):
    torch.manual_seed(head_dim)
    layer = RotaryEmbedding(head_dim, rotary_dim, default_inv_freq(rotary_dim, 10000.0), max_position=512)
    tokens, heads, kv_heads = 9, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    positions = torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 42])
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    expected_q, expected_k = layer.forward_native(positions, q, k)
    got_q, got_k = _installed(layer)(positions, q, k)
    torch.testing.assert_close(got_q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, expected_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@needs_kernels
def test_rotary_rejects_a_position_outside_the_cache():
    layer = _installed(RotaryEmbedding(8, 8, default_inv_freq(8, 10000.0), max_position=16))
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        layer(torch.tensor([3, 16]), torch.randn(2, 1, 8), torch.randn(2, 1, 8))


@needs_kernels
@pytest.mark.parametrize("rows,d", [(1, 8), (33, 96), (256, 1536)])
def test_silu_and_mul(rows, d):
    torch.manual_seed(d)
    x = torch.randn(rows, 2 * d) * 4
    layer = SiluAndMul()
    expected = layer.forward_native(x)
    torch.testing.assert_close(_installed(layer)(x), expected, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_other_dtypes_use_the_torch_code():
    layer = _norm(32)
    assert install_fused_ops(layer, torch.bfloat16) == 0 and layer.platform_forward is None
    _installed(layer)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), layer.forward_native(x))


@pytest.mark.skipif(not packed_linear_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("rows", [0, 1, 8, 100])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    column = ColumnParallelLinear(64, 96, bias=True)
    row = RowParallelLinear(96, 64, bias=False)
    for layer in (column, row):
        for param in layer.parameters():
            param.data.normal_()
    x = torch.randn(rows, 64)
    expected = row(column(x))
    module = torch.nn.Sequential(column, row)
    assert pack_linear_weights(module) == 2
    assert isinstance(column.gemm_override, OneDnnLinear)
    assert column.weight.device.type == "meta" and column.weight.shape == (96, 64)  # dense copy released
    torch.testing.assert_close(row(column(x)), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not packed_linear_available(), reason="no oneDNN in this torch build")
def test_packing_keeps_a_shared_weight_dense():
    from sparrow.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    embedding, head = VocabParallelEmbedding(32, 16), ParallelLMHead(32, 16)
    embedding.weight.data.normal_()
    head.tie_to(embedding)
    hidden = torch.randn(3, 16)
    expected = head.compute_logits(hidden)
    pack_linear_weights(torch.nn.ModuleDict({"embed": embedding, "head": head}))
    assert head.gemm_override is not None and embedding.weight.device.type == "cpu"
    torch.testing.assert_close(head.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embedding(torch.tensor([1, 2])), embedding.weight[[1, 2]])


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("num_rows", [3, 12])  # under 8 rows: split by KV head; 8 and more: one item per row
def test_paged_decode_attention_many_rows_against_torch(head_dim, num_rows):
    from sparrow_cpu.native import get_paged_attention

    kernel = get_paged_attention()
    if kernel is None:
        pytest.skip("no compiler for the C++ kernels")
    torch.manual_seed(num_rows)
    heads, kv_heads, block_size, num_blocks, max_blocks = 8, 2, 4, 96, 7
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    lens = torch.randint(1, max_blocks * block_size + 1, (num_rows,), dtype=torch.int32)
    table = torch.randperm(num_blocks)[: num_rows * max_blocks].view(num_rows, max_blocks).to(torch.int32)
    query = torch.randn(num_rows, heads, head_dim)
    out = torch.empty_like(query)
    rows = torch.arange(num_rows)
    kernel(query, cache, out, rows, rows, torch.arange(num_rows + 1, dtype=torch.int32), lens, table, 0.3)
    for r in range(num_rows):
        n = int(lens[r])
        blocks = table[r, : -(-n // block_size)].long()
        keys = cache[0, blocks].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        values = cache[1, blocks].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        weights = (torch.einsum("hd,shd->hs", query[r], keys) * 0.3).softmax(-1)
        torch.testing.assert_close(out[r], torch.einsum("hs,shd->hd", weights, values), rtol=1e-5, atol=1e-5)
