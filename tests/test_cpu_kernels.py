"""The CPU plugin's op implementations (C++ element-wise kernels, oneDNN packed linears), bound
through the op registry, against the layers' torch references."""

from __future__ import annotations

import pytest
import torch

from sparrow.layers.activation import SiluAndMul
from sparrow.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sparrow.layers.layernorm import RMSNorm
from sparrow.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sparrow.layers.rotary import RotaryEmbedding, default_inv_freq
from sparrow.ops import bind_ops
from sparrow_cpu.fused import CppRMSNorm, CppRotary, CppSiluAndMul
from sparrow_cpu.gemm import OneDnnLinear, packed_linear_available
from sparrow_cpu.native import get_elementwise_ops

needs_kernels = pytest.mark.skipif(get_elementwise_ops() is None, reason="no compiler for the C++ kernels")
needs_onednn = pytest.mark.skipif(not packed_linear_available(), reason="no oneDNN in this torch build")


def _bound(layer: torch.nn.Module, impl_cls: type) -> torch.nn.Module:
    """``layer`` bound on the CPU platform, through the registry as the worker binds a model."""
    summary = bind_ops(layer, "cpu")
    assert isinstance(layer.op_impl, impl_cls), summary
    assert summary == {layer.op_name: {impl_cls.name: 1}}
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
    native = _bound(layer, CppRMSNorm)
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
    native = _bound(layer, CppRMSNorm)
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
    got_q, got_k = _bound(layer, CppRotary)(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, in the QKV output
    torch.testing.assert_close(got_q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, expected_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@needs_kernels
def test_rotary_rejects_a_position_outside_the_cache():
    layer = _bound(RotaryEmbedding(8, 8, default_inv_freq(8, 10000.0), max_position=16), CppRotary)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        layer(torch.tensor([3, 16]), torch.randn(2, 1, 8), torch.randn(2, 1, 8))


@needs_kernels
@pytest.mark.parametrize("rows,d", [(1, 8), (33, 96), (256, 1536)])
def test_silu_and_mul(rows, d):
    torch.manual_seed(d)
    x = torch.randn(rows, 2 * d) * 4
    layer = SiluAndMul()
    expected = layer.forward_native(x)
    torch.testing.assert_close(_bound(layer, CppSiluAndMul)(x), expected, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_other_dtypes_keep_the_torch_reference():
    layer = _norm(32).to(torch.bfloat16)
    assert bind_ops(layer, "cpu") == {"rms_norm": {"native": 1}} and layer.op_impl is None
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), layer.forward_native(x))
    # A bound fp32 kernel handed another dtype falls back to the reference inside the call.
    silu = _bound(SiluAndMul(), CppSiluAndMul)
    torch.testing.assert_close(silu(x.repeat(1, 2)), silu.forward_native(x.repeat(1, 2)))


def _filled(*layers: torch.nn.Module) -> None:
    for layer in layers:
        for param in layer.parameters():
            param.data.normal_()


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 8, 100])
def test_packed_linear_matches_the_reference(rows):
    torch.manual_seed(rows)
    column = ColumnParallelLinear(64, 96, bias=True)
    row = RowParallelLinear(96, 64, bias=False)
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True)
    _filled(column, row, qkv)
    x = torch.randn(rows, 64)
    expected, expected_qkv = row(column(x)), qkv(x)
    module = torch.nn.ModuleList([column, row, qkv])
    assert bind_ops(module, "cpu") == {"linear": {"onednn_packed": 3}}
    assert isinstance(column.op_impl, OneDnnLinear)
    # The packed weight replaced the dense parameter (same logical shape, oneDNN's layout).
    assert column.weight.is_mkldnn and column.weight.shape == (96, 64)
    assert isinstance(column.weight, torch.nn.Parameter)
    torch.testing.assert_close(row(column(x)), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(qkv(x), expected_qkv, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_a_packed_weight_takes_new_weights_and_a_fused_shard_keeps_the_others():
    """An RLHF update after binding: loading into a packed weight unpacks it, loads, repacks."""
    qkv = QKVParallelLinear(16, 4, 2, 1, bias=False)  # q: 8 rows, k: 4, v: 4
    _filled(qkv)
    dense = qkv.weight.detach().clone()
    bind_ops(qkv, "cpu")
    assert qkv.weight.is_mkldnn
    new_k = torch.randn(4, 16)
    qkv.weight.weight_loader(qkv.weight, new_k, "k")
    assert qkv.weight.is_mkldnn  # packed again
    expected = torch.cat([dense[:8], new_k, dense[12:]])
    x = torch.randn(5, 16)
    torch.testing.assert_close(qkv(x), torch.nn.functional.linear(x, expected), rtol=1e-4, atol=1e-4)
    # Loaded twice: the first load's rows stay, only the newly loaded ones change.
    new_q = torch.randn(8, 16)
    qkv.weight.weight_loader(qkv.weight, new_q, "q")
    expected = torch.cat([new_q, new_k, dense[12:]])
    torch.testing.assert_close(qkv(x), torch.nn.functional.linear(x, expected), rtol=1e-4, atol=1e-4)


def test_a_weight_an_implementation_cannot_unpack_refuses_loading_again():
    from sparrow.ops.base import OpImpl

    class Transposed(OpImpl):
        name = "transposed"

        def process_weights(self):
            self.layer.replace_parameter("weight", self.layer.weight.t().contiguous())

    layer = ColumnParallelLinear(16, 8)
    _filled(layer)
    impl = Transposed(layer)
    layer.bind_impl(impl)
    impl.process_weights()
    with pytest.raises(RuntimeError, match=r"ColumnParallelLinear\.weight was repacked by the transposed "
                                           "implementation after loading, which cannot unpack it"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 16))


@needs_onednn
def test_packing_keeps_a_tied_embedding_dense():
    embedding, head = VocabParallelEmbedding(32, 16), ParallelLMHead(32, 16)
    embedding.weight.data.normal_()
    head.tie_to(embedding)
    table = embedding.weight
    hidden = torch.randn(3, 16)
    expected = head.compute_logits(hidden)
    model = torch.nn.ModuleDict({"embed": embedding, "head": head})
    params_before = sum(p.numel() for p in model.parameters())
    assert bind_ops(model, "cpu") == {"embedding": {"native": 1}, "lm_head": {"onednn_packed": 1}}
    assert embedding.weight is table and head.weight is table and not table.is_mkldnn
    assert sum(p.numel() for p in model.parameters()) == params_before  # still one shared table
    torch.testing.assert_close(head.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)
    assert head.compute_logits(hidden).dtype == torch.float32
    torch.testing.assert_close(embedding(torch.tensor([1, 2])), table[[1, 2]])
    # New weights loaded into the shared table reach the head's packed copy.
    new_table = torch.randn(32, 16)
    embedding.weight.weight_loader(embedding.weight, new_table)
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ new_table.T, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_packed_linears_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPARROW_CPU_PACKED_LINEAR", "0")
    layer = ColumnParallelLinear(16, 8)
    _filled(layer)
    assert bind_ops(layer, "cpu") == {"linear": {"native": 1}}
    assert layer.op_impl is None and not layer.weight.is_mkldnn


@pytest.mark.parametrize("head_dim", [64, 128, 48])
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
    kernel(query, cache, out, rows, rows, torch.arange(num_rows + 1, dtype=torch.int32), lens, table, 0.3,
           0, 0.0)
    for r in range(num_rows):
        n = int(lens[r])
        blocks = table[r, : -(-n // block_size)].long()
        keys = cache[0, blocks].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        values = cache[1, blocks].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, 1)
        weights = (torch.einsum("hd,shd->hs", query[r], keys) * 0.3).softmax(-1)
        torch.testing.assert_close(out[r], torch.einsum("hs,shd->hd", weights, values), rtol=1e-5, atol=1e-5)
