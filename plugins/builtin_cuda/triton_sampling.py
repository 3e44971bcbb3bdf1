"""A Triton kernel for the ``sample_from_logits`` function op: one token per row straight from the
logits, at the row's temperature and uniform, served on CUDA.

Why: the sampler's torch path for rows that only scale by a temperature (the common case: no
top-k, top-p, min-p) converts the logits to float32, divides by the temperature, takes a softmax
and inverts the cumulative distribution (``sparrow.sample.sampler.inverse_cdf``): about six full
passes over a ``[B, V]`` float32 matrix per step. This kernel reads the logits once, plus one
block per row:

1. one program per row walks the vocabulary in blocks of ``BLOCK`` tokens and keeps, in registers,
   each block's max ``m_k`` and its sum ``s_k`` of ``exp((l - m_k) / T)`` (float32 sums of 128
   tokens, added in float64): the online max and sum of a softmax, kept per block;
2. the row max ``M`` scales every block's sum to its mass ``s_k * exp((m_k - M) / T)``; the
   float64 cumulative of those masses locates the block holding ``u * total``;
3. that one block is read again and scanned token by token (a block-local float64 ``tl.cumsum``),
   at the target's fraction of the block's mass: the first token whose cumulative exceeds it.

It draws what ``inverse_cdf`` draws (see :func:`sample_from_logits` for the error bound): a
token of zero probability (a -inf logit from a grammar mask or a logit bias) never comes out, and
a target that rounding puts at or past the end takes the last token with mass. Nothing is read
back to the host. Logits may be float32, bfloat16 or float16 with any strides; uniforms float32
or float64.

The launcher takes CPU tensors too, which Triton's interpreter (``TRITON_INTERPRET=1``) runs: that
is how tests/test_triton_sampling.py checks it without a GPU (against the torch reference with the
same uniforms, -inf tokens, half-precision and strided logits, the distribution, seed invariance
through the sampler), and its ``cuda``-marked tests run the same checks on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNIFORM_DTYPES = (torch.float32, torch.float64)
MAX_BLOCK = 4096  # tokens a program holds at a time
CHUNK = 128  # tokens per float32 partial sum (the error bound's C)
_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))


@triton.jit
def _sample_kernel(
    logits_ptr, temperature_ptr, uniforms_ptr, out_ptr,
    V, stride_b, stride_v,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, NUM_BLOCKS_PAD: tl.constexpr,
):
    # grid: (B,). out[row] = the token of row `row` at uniform uniforms[row].
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_b
    scale = tl.math.div_rn(_LOG2E, tl.load(temperature_ptr + row).to(tl.float32))  # exp(x / T) = exp2(x * scale)
    blocks = tl.arange(0, NUM_BLOCKS_PAD)
    tile = tl.arange(0, BLOCK // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [BLOCK // CHUNK, CHUNK]

    # Pass 1: per block, its max and the float64 sum of its float32 chunk sums of exp2((l - max) * scale).
    # Each block is loaded one iteration ahead, so that its load overlaps the reductions of the last.
    block_max = tl.full([NUM_BLOCKS_PAD], float("-inf"), tl.float32)
    block_sum = tl.zeros([NUM_BLOCKS_PAD], tl.float64)
    ahead = tl.load(base + tile.to(tl.int64) * stride_v, mask=tile < V, other=float("-inf"))
    for k in range(0, tl.cdiv(V, BLOCK)):
        logits = ahead.to(tl.float32)
        offs = (k + 1) * BLOCK + tile
        ahead = tl.load(base + offs.to(tl.int64) * stride_v, mask=offs < V, other=float("-inf"))
        peak = tl.max(tl.max(logits, axis=1), axis=0)
        weights = tl.exp2((logits - tl.where(peak == float("-inf"), 0.0, peak)) * scale)  # 0 at -inf
        total = tl.sum(tl.sum(weights, axis=1).to(tl.float64), axis=0)
        block_max = tl.where(blocks == k, peak, block_max)
        block_sum = tl.where(blocks == k, total, block_sum)

    # The blocks' masses relative to the row max, their float64 cumulative, and the target's block:
    # the first whose cumulative exceeds it, or the last with mass when rounding put it at the end.
    row_max = tl.max(block_max, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row of -inf: every mass 0
    mass = block_sum * tl.exp2((block_max - row_max) * scale).to(tl.float64)
    cumulative = tl.cumsum(mass, axis=0)
    row_total = tl.max(cumulative, axis=0)  # non-decreasing: the max is the last
    target = tl.load(uniforms_ptr + row).to(tl.float64) * row_total
    chosen = tl.minimum(tl.sum((cumulative <= target).to(tl.int32), axis=0),
                        tl.sum((cumulative < row_total).to(tl.int32), axis=0))
    before = tl.sum(tl.where(blocks == chosen - 1, cumulative, 0.0), axis=0)
    size = tl.sum(tl.where(blocks == chosen, cumulative, 0.0), axis=0) - before  # > 0 where mass
    chosen_max = tl.max(tl.where(blocks == chosen, block_max, float("-inf")), axis=0)
    chosen_max = tl.where(chosen_max == float("-inf"), 0.0, chosen_max)

    # Pass 2, one block: the same weights, their exact float64 cumulative, at the target's fraction
    # of the block's mass; a fraction rounded up to 1 takes the block's last token with mass.
    cols = chosen * BLOCK + tl.arange(0, BLOCK)
    chosen_logits = tl.load(base + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf")).to(tl.float32)
    inner = tl.cumsum(tl.exp2((chosen_logits - chosen_max) * scale).to(tl.float64), axis=0)
    inner_total = tl.max(inner, axis=0)
    fraction = (target - before) / tl.where(size > 0, size, 1.0)
    offset = tl.minimum(tl.sum((inner <= fraction * inner_total).to(tl.int32), axis=0),
                        tl.sum((inner < inner_total).to(tl.int32), axis=0))
    tl.store(out_ptr + row, (chosen * BLOCK + offset).to(tl.int64))


def _kernel_serves(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors; the torch reference serves the rest."""
    if logits.dtype not in SUPPORTED_DTYPES or uniforms.dtype not in UNIFORM_DTYPES:
        return False
    if temperature.device != logits.device or uniforms.device != logits.device:
        return False
    device = logits.device
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _num_warps(block: int) -> int:
    return min(max(block // 512, 1), 8)


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor, *,
                       block_size: int | None = None) -> torch.Tensor:
    """The ``sample_from_logits`` op (``sparrow.sample.sampler.sample_from_logits``'s signature):
    row r of ``logits`` [B, V] sampled at temperature ``temperature[r]`` (> 0, [B]) and uniform
    ``uniforms[r]`` in [0, 1) ([B], float32 or float64): the first token whose cumulative
    probability exceeds ``u * total``. Returns [B] int64. ``block_size`` (a power of two, at least
    16) forces the vocabulary block (tests: several blocks at a small vocabulary).

    Error bound: a token's weight is its float32 ``exp2((l - m) * log2(e) / T)`` (``m``: the max of
    its block), which rounds the argument and the exponential as the reference's float32 softmax
    does (a relative error of a few 2**-24 times ``1 + |l - m| / T``); a block's weights are summed
    in float32 chunks of C = 128 tokens, each within a factor 1 +- e of its exact sum, e = (C - 1) *
    2**-24 (about 7.6e-6), whatever the summation order; the block's factor ``exp2((m - M) *
    log2(e) / T)`` (``M``: the row max) is float32 too; everything after (chunk sums added, masses,
    cumulative, target, the chosen block's token cumulative) is float64. Each block's share of the
    row is thus off by a factor within 1 +- 2e (plus the exponential's rounding), and a token's
    share of its block is exact to float64: every token, however small, is drawn with its
    probability times a factor within about 1 +- 2e, as ``inverse_cdf`` draws from the reference's
    probabilities. The token is the reference's unless ``u`` lies within that relative distance of a
    token boundary. A zero-probability token never comes out: the chosen block has positive mass
    (its cumulative rises there), and inside it the first token whose cumulative exceeds the target
    has a weight of its own; a target at or past the end takes the last token with mass. (On a GPU
    the exponential flushes results below float32's normal range to 0: a token whose logit lies
    more than ~87 T below its block's max, of probability under 1e-38, is never drawn, as the
    reference never draws one under ~1e-45.)

    Tensors the kernel cannot take (another dtype, mixed devices, CPU tensors without the
    interpreter) are served by the torch reference.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    for name, tensor in (("temperature", temperature), ("uniforms", uniforms)):
        if tensor.shape != (num_rows,):
            raise ValueError(f"{name} {tuple(tensor.shape)} must be [{num_rows}]")
    if block_size is not None and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two of at least 16, got {block_size}")
    if not _kernel_serves(logits, temperature, uniforms):
        from sparrow.sample.sampler import sample_from_logits as reference

        return reference(logits, temperature, uniforms)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if vocab == 0:
        raise ValueError("cannot sample from an empty vocabulary")
    block = block_size or min(MAX_BLOCK, max(16, triton.next_power_of_2(vocab)))
    num_blocks = triton.cdiv(vocab, block)
    _sample_kernel[(num_rows,)](
        logits, temperature.to(torch.float32).contiguous(), uniforms.contiguous(), out,
        vocab, logits.stride(0), logits.stride(1),
        BLOCK=block, CHUNK=min(CHUNK, block), NUM_BLOCKS_PAD=max(2, triton.next_power_of_2(num_blocks)),
        num_warps=_num_warps(block),
    )
    return out
