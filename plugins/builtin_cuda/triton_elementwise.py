"""Triton kernels for the element-wise layers, and the op implementations that serve them on CUDA.

Each kernel reads and writes its rows once (the torch references spend several passes per call):

* ``rms_norm(x, weight, eps)``: one program per row of ``x`` (``[..., D]``, unit inner stride; a
  3-D ``x`` may have any outer strides, e.g. the q/k heads of a fused QKV output). New output.
* ``fused_add_rms_norm(x, residual, weight, eps)``: in place, ``residual = x + residual`` and then
  ``x = rms_norm(residual)``; both contiguous and of one shape.
* ``silu_and_mul(x)``: ``silu(x[..., :d]) * x[..., d:]`` of a contiguous ``[..., 2d]``. New output.
* ``rotary_neox(positions, query, key, cos_sin_cache, rotary_dim)``: in place on ``[T, H, D]``
  views (unit inner stride); the first ``rotary_dim`` dims of every head are rotated, the rest
  pass through.

Arithmetic and rounding follow the layers' ``forward_native`` so low-precision results agree:
fp32 statistics, the normalised value cast to the input dtype before the weight multiply, silu
rounded before the multiply, cos/sin and each rotary product rounded to the query dtype. The launchers take CPU tensors
too, which Triton's interpreter (``TRITON_INTERPRET=1``) runs: that is how they are tested
without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from sparrow.ops.base import OpImpl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One program holds a whole row (or a token's heads) in registers; past this it would spill.
MAX_ROW_BLOCK = 65536
_SILU_BLOCK = 1024


def _num_warps(block: int) -> int:
    return min(max(block // 512, 1), 8)


@triton.jit
def _normalize_row(x, weight_ptr, out_ptr, cols, mask, hidden_size, eps):
    """fp32 row -> ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` in out_ptr's dtype."""
    out_dtype = out_ptr.dtype.element_ty
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.rsqrt(variance + eps)).to(out_dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    return (normed.to(tl.float32) * weight.to(tl.float32)).to(out_dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, rows_per_group, stride_x_group, stride_x_row,
                     hidden_size, eps, BLOCK: tl.constexpr):
    # grid: (num_rows,); x is seen as [groups, rows_per_group, hidden_size], out is contiguous.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // rows_per_group) * stride_x_group + (row % rows_per_group) * stride_x_row
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normalize_row(x, weight_ptr, out_ptr, cols, mask, hidden_size, eps)
    tl.store(out_ptr + row * hidden_size + cols, out, mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, hidden_size, eps, BLOCK: tl.constexpr):
    # grid: (num_rows,); x and residual contiguous [num_rows, hidden_size], both written in place.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    offsets = row * hidden_size + cols
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the storage dtype first: the reference adds in that dtype, then normalises.
    summed = (x + residual).to(residual_ptr.dtype.element_ty)
    tl.store(residual_ptr + offsets, summed, mask=mask)
    out = _normalize_row(summed.to(tl.float32), weight_ptr, x_ptr, cols, mask,
                         hidden_size, eps)
    tl.store(x_ptr + offsets, out, mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr):
    # grid: (num_rows, cdiv(d, BLOCK)); x contiguous [num_rows, 2 * d], out contiguous [num_rows, d].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype)  # the reference rounds silu's output
    tl.store(out_ptr + row * d + cols, (silu.to(tl.float32) * up).to(out_dtype), mask=mask)


@triton.jit
def _rotate_heads(head0_ptr, stride_head, num_heads, cos, sin, dims, dim_mask, half,
                  HEADS_PAD: tl.constexpr):
    """Rotate pairs (i, i + half) of every head of one token in place; cos/sin are [HALF_PAD]."""
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads[:, None] < num_heads) & dim_mask[None, :]
    first = head0_ptr + heads[:, None] * stride_head + dims[None, :]  # [HEADS_PAD, HALF_PAD]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    dtype = head0_ptr.dtype.element_ty
    cos, sin = cos[None, :], sin[None, :]
    # Each product rounded to the storage dtype before the sum, as the reference computes in it
    # (no-ops in float32): bf16/fp16 results then equal the reference's bit for bit.
    x1_cos, x2_sin = (x1 * cos).to(dtype).to(tl.float32), (x2 * sin).to(dtype).to(tl.float32)
    x2_cos, x1_sin = (x2 * cos).to(dtype).to(tl.float32), (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(first + half, (x2_cos + x1_sin).to(dtype), mask=mask)


@triton.jit
def _rotary_neox_kernel(positions_ptr, query_ptr, key_ptr, cos_sin_ptr,
                        stride_q_token, stride_q_head, stride_k_token, stride_k_head,
                        num_q_heads, num_k_heads, ROTARY_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
                        Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr):
    # grid: (num_tokens,); cos_sin_cache contiguous [max_position, ROTARY_DIM] fp32 (cos | sin).
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half = ROTARY_DIM // 2
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < half
    angles = cos_sin_ptr + position * ROTARY_DIM + dims
    # The reference casts the cached angles to the query dtype before rotating.
    angle_dtype = query_ptr.dtype.element_ty
    cos = tl.load(angles, mask=dim_mask, other=0.0).to(angle_dtype).to(tl.float32)
    sin = tl.load(angles + half, mask=dim_mask, other=0.0).to(angle_dtype).to(tl.float32)
    _rotate_heads(query_ptr + token * stride_q_token, stride_q_head, num_q_heads, cos, sin, dims,
                  dim_mask, half, Q_HEADS_PAD)
    _rotate_heads(key_ptr + token * stride_k_token, stride_k_head, num_k_heads, cos, sin, dims,
                  dim_mask, half, K_HEADS_PAD)


# -- launchers: tensors in, tensors out; they raise ValueError for layouts the kernels do not take --

def rms_norm_layout(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(rows_per_group, stride_group, stride_row)`` addressing the rows of ``x``, or None when
    its layout is not one the kernel reads (inner stride not 1, or a non-contiguous x of rank > 3)."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    if x.dim() == 3:
        return x.shape[1], x.stride(0), x.stride(1)
    if x.dim() == 2:
        return 1, x.stride(0), 0
    if x.is_contiguous():
        return 1, x.shape[-1], 0
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, as a new contiguous tensor."""
    hidden_size = x.shape[-1]
    layout = rms_norm_layout(x)
    if layout is None:
        raise ValueError("rms_norm needs x with a unit inner stride (and contiguous when of rank > 3)")
    if weight.shape != (hidden_size,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm weight must be contiguous [{hidden_size}], got {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x.numel() // hidden_size if hidden_size else 0
    if num_rows == 0:
        return out
    rows_per_group, stride_group, stride_row = layout
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](x, weight, out, rows_per_group, stride_group, stride_row,
                                  hidden_size, eps, BLOCK=block, num_warps=_num_warps(block))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual = x + residual``, then ``x = rms_norm(residual)``."""
    if not (x.is_contiguous() and residual.is_contiguous()) or x.shape != residual.shape \
            or x.dtype != residual.dtype:
        raise ValueError("fused_add_rms_norm needs contiguous x and residual of one shape and dtype")
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm weight must be contiguous [{hidden_size}], got {tuple(weight.shape)}")
    num_rows = x.numel() // hidden_size if hidden_size else 0
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden_size)
    _fused_add_rms_norm_kernel[(num_rows,)](x, residual, weight, hidden_size, eps, BLOCK=block,
                                            num_warps=_num_warps(block))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` -> ``[..., d]``."""
    if not x.is_contiguous() or x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError("silu_and_mul needs a contiguous x whose last dim is even")
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    num_rows = out.numel() // d if d else 0
    if num_rows == 0:
        return out
    block = min(triton.next_power_of_2(d), _SILU_BLOCK)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](x, out, d, BLOCK=block,
                                                             num_warps=_num_warps(block))
    return out


def rotary_tile(num_heads: int, rotary_dim: int) -> int:
    """Elements of one token's [heads, rotary_dim / 2] tile as the kernel pads it."""
    return triton.next_power_of_2(num_heads) * triton.next_power_of_2(max(rotary_dim // 2, 1))


def rotary_neox(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                cos_sin_cache: torch.Tensor, rotary_dim: int) -> None:
    """Rotate the first ``rotary_dim`` dims of every query/key head in place (neox layout).

    positions [T] int; query [T, Hq, D], key [T, Hkv, D] with unit inner strides; cos_sin_cache
    [max_position, rotary_dim] fp32. Positions are not range-checked (that would sync the GPU).
    """
    num_tokens = positions.shape[0]
    if query.dim() != 3 or key.dim() != 3 or query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("rotary_neox needs query and key as [T, H, D] with a unit inner stride")
    if positions.dim() != 1 or query.shape[0] != num_tokens or key.shape[0] != num_tokens:
        raise ValueError("rotary_neox needs one position per query and key row")
    if rotary_dim % 2 or rotary_dim > query.shape[-1] or rotary_dim > key.shape[-1]:
        raise ValueError(f"rotary_dim must be even and at most head_dim, got {rotary_dim}")
    if not cos_sin_cache.is_contiguous() or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache must be contiguous [max_position, {rotary_dim}]")
    if num_tokens == 0:
        return
    _rotary_neox_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), query.shape[1], key.shape[1],
        ROTARY_DIM=rotary_dim, HALF_PAD=triton.next_power_of_2(max(rotary_dim // 2, 1)),
        Q_HEADS_PAD=triton.next_power_of_2(query.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(key.shape[1]),
        num_warps=_num_warps(rotary_tile(query.shape[1], rotary_dim)))


# -- op implementations (registered for platform "cuda" by sparrow_cuda.ops) -----------------------
# supports() decides once per layer from its weights' device and dtype; __call__ checks only what
# varies per call (dtype, layout) and hands anything else to the layer's torch reference.

def _on_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" and tensor.dtype in SUPPORTED_DTYPES


class TritonRMSNorm(OpImpl):
    """RMSNorm and fused residual add + RMSNorm; the fused form works in place on x and residual."""

    name = "triton"

    @classmethod
    def supports(cls, layer: Any) -> bool:
        return _on_cuda(layer.weight) and triton.next_power_of_2(layer.hidden_size) <= MAX_ROW_BLOCK

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        layer = self.layer
        weight = layer.weight
        if x.dtype != weight.dtype or x.shape[-1] != layer.hidden_size:
            return layer.forward_native(x, residual)
        if residual is None:
            if rms_norm_layout(x) is None:
                return layer.forward_native(x)
            return rms_norm(x, weight, layer.eps)
        if not (x.is_contiguous() and residual.is_contiguous()) or residual.shape != x.shape \
                or residual.dtype != x.dtype:
            return layer.forward_native(x, residual)
        fused_add_rms_norm(x, residual, weight, layer.eps)
        return x, residual


class TritonSiluAndMul(OpImpl):
    """``silu(gate) * up`` in one pass."""

    name = "triton"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in SUPPORTED_DTYPES or not x.is_contiguous() or x.dim() == 0 or x.shape[-1] % 2:
            return self.layer.forward_native(x)
        return silu_and_mul(x)


class TritonRotaryEmbedding(OpImpl):
    """Neox rotary embedding, in place on query and key; returns them."""

    name = "triton"

    @classmethod
    def supports(cls, layer: Any) -> bool:
        cache = layer.cos_sin_cache
        return (cache.device.type == "cuda" and cache.dtype == torch.float32 and cache.is_contiguous()
                and cache.dim() == 2 and cache.shape[1] == layer.rotary_dim and layer.rotary_dim % 2 == 0)

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> Any:
        layer = self.layer
        rotary_dim = layer.rotary_dim
        if (query.dtype not in SUPPORTED_DTYPES or key.dtype != query.dtype
                or query.dim() != 3 or key.dim() != 3 or query.stride(-1) != 1 or key.stride(-1) != 1
                or positions.dim() != 1 or query.shape[0] != positions.shape[0]
                or key.shape[0] != positions.shape[0]
                or rotary_tile(max(query.shape[1], key.shape[1]), rotary_dim) > MAX_ROW_BLOCK):
            return layer.forward_native(positions, query, key)
        rotary_neox(positions, query, key, layer.cos_sin_cache, rotary_dim)
        return query, key
