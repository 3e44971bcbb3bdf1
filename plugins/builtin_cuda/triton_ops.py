"""Triton kernels for the paged KV cache: attending over a mixed batch (the cache write is in
``sparrow_cuda.triton_cache``).

Layouts (see ``sparrow.attention``):

* new keys/values      ``[num_tokens, num_kv_heads, head_dim]`` (any strides)
* paged KV cache       ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0: keys, 1: values)
* query / output       ``[num_tokens, num_heads, head_dim]``

``unified_paged_attention`` runs one kernel over the whole step. A program owns one *query tile*
(``block_q`` consecutive new tokens of one request) and one kv head, and processes every query head
of that kv head's GQA group at once, so K/V read from the cache are reused ``num_heads //
num_kv_heads`` times. The tile's rows are (token, head-in-group) pairs flattened into
``BLOCK_M = block_q * group_pad`` rows. Keys are visited ``TILE_N`` at a time through the block
table with an online softmax; tiles wholly below the causal diagonal skip the mask.

A sliding window ``W`` (token at ``p`` sees keys ``p - W + 1 .. p``) starts the tile loop at the
tile holding the first key the tile's first token sees, and keys before that are never loaded (the
KV cache manager may have freed their blocks); tiles that some row sees only partly are masked.
Logit soft-capping replaces each scaled score ``s`` with ``c * tanh(s / c)`` before the mask.

An fp8 cache (``kv_cache_dtype="fp8"``: float8_e4m3fn) holds ``x / scale`` with one scale per
layer for keys and one for values: the write kernel quantizes (saturating at +-448), the attention
kernel converts the tiles it loads to the query's dtype (exact) and applies the scales outside the
dot products (``k_scale`` in the softmax scale, ``v_scale`` on the output).

Optionally the key range is cut into ``NUM_SPLITS`` segments run by separate programs
(flash-decoding), each writing a partial output and its log-sum-exp, merged by a second kernel. That
only pays off when there are few query tiles (small decode batches over long contexts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow_cuda.triton_cache import FP8_KV_DTYPE, _is_fp8_cache, reshape_and_cache  # noqa: F401 - re-exported

_LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact at both ends in fp32 (e^2x overflows to inf -> 1, underflows -> -1).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, tile_start, kv_start, kv_end, query_pos,
    key_cache_ptr, value_cache_ptr, block_table_row_ptr, kv_head,
    stride_c_block, stride_c_slot, stride_c_head, qk_scale, window, soft_cap_log2,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Fold keys [tile_start, tile_start + TILE_N) into the running softmax of the query tile.

    ``CAUSAL_MASK``: some row of the tile must not see some key of it (the causal diagonal or,
    with ``SLIDING``, the window's start); keys outside [kv_start, kv_end) are not even loaded."""
    key_pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    in_range = (key_pos < kv_end) & (key_pos >= kv_start)
    page = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE, mask=in_range, other=0)
    row_off = (page.to(tl.int64) * stride_c_block + (key_pos % BLOCK_SIZE) * stride_c_slot
               + kv_head * stride_c_head)  # [TILE_N]
    k_ptrs = key_cache_ptr + row_off[None, :] + dims[:, None]  # [HEAD_DIM_PAD, TILE_N]
    v_ptrs = value_cache_ptr + row_off[:, None] + dims[None, :]  # [TILE_N, HEAD_DIM_PAD]
    if CAUSAL_MASK:
        k_mask = in_range[None, :] & (dims[:, None] < HEAD_DIM)
        v_mask = in_range[:, None] & (dims[None, :] < HEAD_DIM)
        k_t = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    elif HEAD_DIM != HEAD_DIM_PAD:
        k_t = tl.load(k_ptrs, mask=dims[:, None] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
    else:
        k_t = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if KV_FP8:
        # e4m3 -> the query's dtype is exact; the scales are folded into qk_scale and the output.
        k_t = k_t.to(q.dtype)
        v = v.to(q.dtype)
    elif DOT_IN_FP32:
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)

    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2 units
    if SOFT_CAP:  # c tanh(s / c) in natural units is C tanh(s' / C) in log2 units, C = c log2(e)
        s = soft_cap_log2 * _tanh(s / soft_cap_log2)
    if CAUSAL_MASK:
        visible = (key_pos[None, :] <= query_pos[:, None]) & in_range[None, :]
        if SLIDING:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row may have seen no key yet (in a later split segment, an early token of the tile
        # sees none): use 0 as its reference so exp2 gives 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])  # [BLOCK_M, TILE_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _unified_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, num_reqs, qk_scale, v_scale, window,
    soft_cap_log2, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt_req,
    stride_po_tok, stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    # grid: (num_query_tiles_upper_bound, num_kv_heads, NUM_SPLITS)
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

    # Request i owns query tiles [first_tile(i), first_tile(i+1)) with
    # first_tile(i) = (query_start_loc[i] + i * (BLOCK_Q - 1)) // BLOCK_Q; the i * (BLOCK_Q - 1)
    # term guarantees at least cdiv(query_len_i, BLOCK_Q) tiles each. Binary search for i.
    lo = tile_id * 0  # a scalar int32 tensor: loop-carried below
    hi = lo + num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_first = (tl.load(query_start_loc_ptr + mid) + mid * (BLOCK_Q - 1)) // BLOCK_Q
        lo = tl.where(mid_first <= tile_id, mid, lo)
        hi = tl.where(mid_first <= tile_id, hi, mid)
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_tile = (q_start + req * (BLOCK_Q - 1)) // BLOCK_Q
    q_block_start = (tile_id - first_tile) * BLOCK_Q  # first new token of this tile, in-request
    if q_block_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len  # tokens cached before this step's chunk

    rows = tl.arange(0, BLOCK_M)
    token_in_req = q_block_start + rows // GROUP_PAD  # [BLOCK_M]
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (token_in_req < query_len) & (head_in_group < GROUP)
    query_pos = context_len + token_in_req  # [BLOCK_M] absolute position of each row's token
    dims = tl.arange(0, HEAD_DIM_PAD)
    token = (q_start + token_in_req).to(tl.int64)
    q_ptrs = (query_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head
              + dims[None, :])
    q = tl.load(q_ptrs, mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Keys this tile may see: up to the position of its last token, and with a window from the
    # first key its first token sees.
    kv_end = tl.minimum(seq_len, context_len + q_block_start + BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    # Tiles wholly at or below the tile's first query position need no causal mask.
    num_free_tiles = (context_len + q_block_start + 1) // TILE_N
    if SLIDING:
        kv_start = tl.maximum(context_len + q_block_start - window + 1, 0)
        first_tile = kv_start // TILE_N
        # Tiles from this one on lie wholly inside the window of the tile's last token (and so
        # of every token of the tile).
        window_free_lo = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N)
    else:
        kv_start = 0
        first_tile = 0
        window_free_lo = 0
    if NUM_SPLITS == 1:
        tile_lo = first_tile
        tile_hi = num_tiles
    else:
        tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_lo = tl.minimum(first_tile + split * tiles_per_split, num_tiles)
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    # [tile_lo, free_lo): window-masked; [free_lo, free_hi): no mask; [free_hi, tile_hi): masked.
    free_lo = tl.minimum(tile_hi, tl.maximum(window_free_lo, tile_lo))
    free_hi = tl.minimum(tile_hi, tl.maximum(num_free_tiles, free_lo))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
    if SLIDING:
        for t in range(tile_lo, free_lo):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, t * TILE_N, kv_start, kv_end, query_pos,
                key_cache_ptr, value_cache_ptr, block_table_row_ptr, kv_head,
                stride_c_block, stride_c_slot, stride_c_head, qk_scale, window, soft_cap_log2,
                BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, True, DOT_PRECISION, DOT_IN_FP32,
                SLIDING, SOFT_CAP, KV_FP8)
    for t in range(free_lo, free_hi):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, t * TILE_N, kv_start, kv_end, query_pos,
            key_cache_ptr, value_cache_ptr, block_table_row_ptr, kv_head,
            stride_c_block, stride_c_slot, stride_c_head, qk_scale, window, soft_cap_log2,
            BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, False, DOT_PRECISION, DOT_IN_FP32,
            SLIDING, SOFT_CAP, KV_FP8)
    for t in range(free_hi, tile_hi):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, t * TILE_N, kv_start, kv_end, query_pos,
            key_cache_ptr, value_cache_ptr, block_table_row_ptr, kv_head,
            stride_c_block, stride_c_slot, stride_c_head, qk_scale, window, soft_cap_log2,
            BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, True, DOT_PRECISION, DOT_IN_FP32,
            SLIDING, SOFT_CAP, KV_FP8)

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / safe_l[:, None]
    if KV_FP8:  # sum_j p_j (v_j * v_scale) = v_scale * sum_j p_j v_j; linear, so splits merge alike
        acc = acc * v_scale
    store_mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    if NUM_SPLITS == 1:
        o_ptrs = (out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head
                  + dims[None, :])
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # An empty segment leaves m_i = -inf, l_i = 0: its lse is -inf and it weighs nothing.
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))  # [BLOCK_M], log2 units
        po_ptrs = (partial_out_ptr + token[:, None] * stride_po_tok
                   + head[:, None] * stride_po_head + split * stride_po_split + dims[None, :])
        tl.store(po_ptrs, acc, mask=store_mask)
        pl_ptrs = partial_lse_ptr + token * stride_pl_tok + head * stride_pl_head + split
        tl.store(pl_ptrs, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, query_start_loc_ptr, num_reqs,
    stride_po_tok, stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    # grid: (num_tokens, num_heads)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # padding rows past the last request
        return
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(partial_lse_ptr + token * stride_pl_tok + head * stride_pl_head + splits)
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # [NUM_SPLITS]; split 0 is never empty
    po_ptrs = (partial_out_ptr + token * stride_po_tok + head * stride_po_head
               + splits[:, None] * stride_po_split + dims[None, :])
    partial = tl.load(po_ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)  # [NUM_SPLITS, D_PAD]
    merged = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims,
             merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _target_programs(device: torch.device) -> int:
    """About two waves of programs keeps every SM busy."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def unified_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context after this step
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_kv_splits: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal paged attention for a mixed prefill/decode batch; returns ``out``.

    ``max_query_len``/``max_seq_len`` only pick tile sizes and the split count: the result is the
    same for any values (a CUDA graph captured with one value replays correctly with others).
    Rows of ``out`` past ``query_start_loc[-1]`` (padding) are left untouched.
    ``sliding_window`` W: token at ``p`` sees keys ``p - W + 1 .. p`` only; ``logits_soft_cap`` c:
    each scaled score ``s`` becomes ``c * tanh(s / c)``. An fp8 cache (float8_e4m3fn) is read as
    ``stored * k_scale`` / ``stored * v_scale`` (the scales ``reshape_and_cache`` wrote it with).
    ``num_kv_splits`` (power of two; None = heuristic), ``block_m`` (rows per program,
    token x GQA head), ``tile_n`` (keys per iteration) override the defaults, e.g. for tests.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads {num_heads}x{head_dim} do not fit the cache's "
                         f"{num_kv_heads}x{cache_head_dim}")
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    kv_fp8 = _is_fp8_cache(kv_cache, k_scale, v_scale)
    if query.stride(2) != 1 or out.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("unified_paged_attention needs a contiguous head_dim axis")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Defaults measured on an H100 (bf16): 64-row query tiles beat 128 once decodes share the
    # batch; 64 keys per step (128 at head_dim 64) keep a 4-warp program fed.
    decode_only = max_query_len <= 1
    if block_m is None:
        # tl.dot needs >= 16 rows; decode tiles hold one token (x the GQA group), prefill many.
        block_m = 16 if decode_only else 64
    block_m = max(block_m, group_pad, 16)
    block_q = max(1, block_m // group_pad)
    if tile_n is None:
        tile_n = 32 if head_dim_pad > 128 else (128 if head_dim_pad <= 64 and not decode_only
                                                 else 64)
    num_q_tiles = (num_tokens + num_reqs * (block_q - 1)) // block_q

    if num_kv_splits is None:
        num_kv_splits = 1
        if max_query_len <= block_q and query.device.type == "cuda":
            programs = num_reqs * num_kv_heads
            wanted = min(triton.cdiv(_target_programs(query.device), programs),
                         triton.cdiv(max_seq_len, 4 * tile_n), 32)
            while num_kv_splits * 2 <= wanted:
                num_kv_splits *= 2
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")

    if num_kv_splits > 1:
        # [num_tokens, num_heads, num_splits, head_dim_pad] and [num_tokens, num_heads, num_splits]
        partial_out = torch.empty((num_tokens, num_heads, num_kv_splits, head_dim_pad),
                                  dtype=torch.float32, device=query.device)
        partial_lse = torch.empty((num_tokens, num_heads, num_kv_splits),
                                  dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused by the kernel in this configuration
    if num_warps is None:
        num_warps = 8 if block_m * head_dim_pad >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 2 if head_dim_pad >= 256 else 3
    _unified_attention_kernel[(num_q_tiles, num_kv_heads, num_kv_splits)](
        query, key_cache, value_cache, out, partial_out, partial_lse,
        query_start_loc, seq_lens, block_table, num_reqs,
        # q.(k_scale k) = k_scale (q.k): the key scale folds into the softmax scale.
        scale * (k_scale if kv_fp8 else 1.0) * _LOG2E, float(v_scale) if kv_fp8 else 1.0,
        sliding_window or 0, (logits_soft_cap or 1.0) * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        partial_out.stride(0), partial_out.stride(1),
        partial_out.stride(2) if num_kv_splits > 1 else 0,
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, TILE_N=tile_n, NUM_SPLITS=num_kv_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # Triton's CPU interpreter computes bf16 tl.dot wrongly; it only ever runs on CPU tensors.
        DOT_IN_FP32=query.device.type == "cpu" and query.dtype == torch.bfloat16,
        SLIDING=sliding_window is not None, SOFT_CAP=logits_soft_cap is not None, KV_FP8=kv_fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            partial_out, partial_lse, out, query_start_loc, num_reqs,
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_kv_splits,
            num_warps=4,
        )
    return out
