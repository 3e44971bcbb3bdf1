"""Triton kernel that writes a step's new keys and values into the paged KV cache.

Layouts (see ``sparrow.attention``): new keys/values ``[num_tokens, num_kv_heads, head_dim]`` (any
strides); the paged cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0: keys, 1:
values); ``slot_mapping[t]`` is token t's slot (block * block_size + offset), -1 for padding.

An fp8 cache (``kv_cache_dtype="fp8"``: float8_e4m3fn) holds ``x / scale`` with one scale per
layer for keys and one for values; the kernel quantizes, saturating at +-448.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# kv_cache_dtype="fp8" stores float8_e4m3fn: finite range +-448, 3 mantissa bits.
FP8_KV_DTYPE = torch.float8_e4m3fn


def _is_fp8_cache(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Whether ``kv_cache`` holds fp8 (quantized with the scales), checking the scales."""
    if kv_cache.dtype == FP8_KV_DTYPE:
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"fp8 KV cache scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
        return True
    if kv_cache.dtype.itemsize == 1:
        raise ValueError(f"KV cache dtype {kv_cache.dtype} is not supported (fp8 caches are float8_e4m3fn)")
    return False


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_slot, stride_c_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr, FP8: tl.constexpr,
):
    # grid: (num_tokens, cdiv(num_kv_heads * head_dim, BLOCK_E)); the last dim of every tensor is
    # contiguous (checked by the launcher).
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE

    elems = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E] over (head, dim)
    mask = elems < NUM_KV_HEADS * HEAD_DIM
    head = elems // HEAD_DIM
    dim = elems % HEAD_DIM
    src_k = token.to(tl.int64) * stride_k_tok + head * stride_k_head + dim
    src_v = token.to(tl.int64) * stride_v_tok + head * stride_v_head + dim
    dst = block * stride_c_block + offset_in_block * stride_c_slot + head * stride_c_head + dim
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    if FP8:  # quantize: value / scale, saturated to e4m3's finite range (the cast alone would overflow)
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)  # 448: e4m3fn's largest finite
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key/value row into ``kv_cache`` at its slot; slots < 0 are skipped.

    An fp8 cache (float8_e4m3fn) stores ``clamp(x / scale, -448, 448)`` rounded to e4m3, with
    the per-tensor ``k_scale`` / ``v_scale``; other caches store ``x`` cast to their dtype."""
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key/value rows {tuple(key.shape[1:])} do not match the cache "
                         f"({num_kv_heads} kv heads x {head_dim})")
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    fp8 = _is_fp8_cache(kv_cache, k_scale, v_scale)
    if key.stride(2) != 1 or value.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("reshape_and_cache needs the head_dim axis of key, value and cache "
                         "to be contiguous")
    elems = num_kv_heads * head_dim
    block_e = min(triton.next_power_of_2(elems), 2048)
    grid = (num_tokens, triton.cdiv(elems, block_e))
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_E=block_e, FP8=fp8,
        num_warps=4 if block_e >= 1024 else 2,
    )
