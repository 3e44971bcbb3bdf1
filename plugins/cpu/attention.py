"""Paged attention in plain torch, for the CPU platform.

One step's work, per layer:

1. write: the new keys/values go into the paged cache at ``slot_mapping`` with one
   ``index_copy_`` per cache (padding slots, ``-1``, are left out);
2. decodes (requests with one new token), all at once: each request's blocks are gathered through
   the block table into a padded ``[B, max_seq_len, Hkv, D]`` tensor and attended with a length mask;
3. prefill chunks, one request at a time: with no cached context the new keys/values are used
   directly with a causal mask; otherwise the request's cached and new keys are gathered from the
   cache and the causal mask is offset by the context length.

The split of the batch into decodes and prefills is planned once per step (``prepare``) and shared
by every layer. The cache must hold finite values everywhere (allocate it with ``torch.zeros``):
padded positions are masked out, but a NaN in an unused slot would still poison a product.

Sliding window ``W`` (token at ``p`` sees keys ``p - W + 1 .. p``): a request's keys are gathered
from the block holding the first key its first new token sees, and the keys of that block before
the window are masked. Blocks wholly before the window, which the KV cache manager may have freed
(their table entries then name block 0 or another request's block), are never read. Each window's
plan is made by the first layer of the step that uses it and reused by the others. Logit
soft-capping (``c * tanh(s / c)`` of the scaled scores) has no ``scaled_dot_product_attention``
form: those layers attend with explicit matmuls and a float32 softmax.

A cache in another dtype than the model's (``kv_cache_dtype="bfloat16"`` for a float32 model)
stores the new keys and values converted to it; attention reads them back in the model's dtype.
A prefill without cached context uses its new keys and values rounded the same way, so that every
path (chunked or not, served from the prefix cache or not) attends to the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sparrow.attention import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class PrefillChunk:
    """The new tokens of one request with more than one new token."""

    start: int  # first row of the chunk in the flat batch
    end: int
    request_index: int
    context_len: int  # tokens already cached before this step
    seq_len: int  # context_len + (end - start)
    # [1, 1, query_len, seq_len - first_key] bool (True: attend), or None for plain causal over
    # the new keys (no context, no window cutting into the chunk)
    mask: torch.Tensor | None
    # Keys are gathered from the cache from this position on (a block boundary); the chunk's own
    # new keys are used directly when there is no context.
    first_key: int = 0


@dataclass(slots=True)
class DecodeGroup:
    """Every request with exactly one new token, attended as one padded batch."""

    # [B] int64 rows of the decode tokens in the flat batch, or None when they are rows 0..B-1
    rows: torch.Tensor | None
    num_reqs: int
    block_table: torch.Tensor  # [B, max_blocks] int32: the blocks to gather, in order
    # [B, 1, 1, max_seq_len] bool (True: attend), or None when every request has max_seq_len tokens
    mask: torch.Tensor | None
    max_seq_len: int  # keys gathered per request (whole blocks for a windowed group)
    # For the C++ kernel: [B] int64 flat rows of the decode tokens and their request indices.
    native_rows: torch.Tensor | None = None
    native_reqs: torch.Tensor | None = None


@dataclass(slots=True)
class TorchAttentionPlan:
    """Step-level work shared by all layers (stored in ``metadata.backend_state``)."""

    num_actual_tokens: int
    # [N] int64 rows whose slot is written, or None for rows 0..num_actual_tokens-1
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor  # [N] int64
    decode: DecodeGroup | None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # What the per-window plans are made from: every request's seq_len, the decodes' indices.
    seq_lens: list[int] = field(default_factory=list)
    decode_indices: list[int] = field(default_factory=list)
    # sliding window -> (decode group, prefill chunks) of the layers with that window
    windowed: dict[int, tuple[DecodeGroup | None, list[PrefillChunk]]] = field(default_factory=dict)


class TorchPagedAttention(AttentionBackend):
    name = "torch"
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supported_kv_cache_dtypes = ("auto", "bfloat16")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The C++ decode kernel (sparrow_cpu.native), or None to stay in plain torch.
        from sparrow_cpu.native import get_paged_attention

        self.native_paged_attention = get_paged_attention() if self.dtype in (torch.float32, torch.bfloat16) else None

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.backend_state = self.plan(metadata)

    def plan(self, metadata: AttentionMetadata) -> TorchAttentionPlan:
        """Split the step into a decode group and prefill chunks (host-side bookkeeping)."""
        query_start_loc = _host(metadata.query_start_loc_cpu, metadata.query_start_loc).tolist()
        seq_lens = _host(metadata.seq_lens_cpu, metadata.seq_lens).tolist()
        num_reqs = metadata.num_reqs
        if len(query_start_loc) < num_reqs + 1 or len(seq_lens) < num_reqs:
            raise ValueError(
                f"query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries and seq_lens {num_reqs}; "
                f"got {len(query_start_loc)} and {len(seq_lens)}"
            )
        decode_indices: list[int] = []
        prefills: list[PrefillChunk] = []
        for index in range(num_reqs):
            start, end = query_start_loc[index], query_start_loc[index + 1]
            query_len, seq_len = end - start, seq_lens[index]
            if query_len > seq_len:
                raise ValueError(f"seq_lens[{index}] = {seq_len} is smaller than its query length {query_len}")
            if query_len == 1:
                decode_indices.append(index)
            elif query_len > 1:
                prefills.append(self._plan_prefill(start, end, index, seq_len))
        write_rows, write_slots = self._plan_writes(metadata)
        return TorchAttentionPlan(
            num_actual_tokens=metadata.num_actual_tokens,
            write_rows=write_rows,
            write_slots=write_slots,
            decode=self._plan_decodes(metadata, decode_indices, query_start_loc, seq_lens),
            prefills=prefills,
            seq_lens=seq_lens[:num_reqs],
            decode_indices=decode_indices,
        )

    def _plan_writes(self, metadata: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
        slots = metadata.slot_mapping[: metadata.num_actual_tokens].to(torch.int64)
        valid = slots >= 0
        if bool(valid.all()):
            return None, slots
        rows = valid.nonzero().squeeze(1)
        return rows, slots.index_select(0, rows)

    def _plan_prefill(self, start: int, end: int, index: int, seq_len: int) -> PrefillChunk:
        query_len = end - start
        context_len = seq_len - query_len
        mask = None
        if context_len > 0:
            # new token j sits at position context_len + j and sees keys at positions <= its own
            key_positions = torch.arange(seq_len, device=self.device)
            query_positions = torch.arange(context_len, seq_len, device=self.device)
            mask = (key_positions[None, :] <= query_positions[:, None])[None, None]
        return PrefillChunk(start, end, index, context_len, seq_len, mask)

    def _plan_decodes(self, metadata: AttentionMetadata, indices: list[int],
                      query_start_loc: list[int], seq_lens: list[int]) -> DecodeGroup | None:
        if not indices:
            return None
        if self.native_paged_attention is not None:
            # The C++ kernel walks the block table itself: no gathered table, no mask.
            return DecodeGroup(
                rows=None, num_reqs=len(indices), block_table=metadata.block_table, mask=None,
                max_seq_len=max(seq_lens[i] for i in indices),
                native_rows=torch.tensor([query_start_loc[i] for i in indices], dtype=torch.int64),
                native_reqs=torch.tensor(indices, dtype=torch.int64),
            )
        num_reqs = metadata.num_reqs
        if len(indices) == num_reqs and query_start_loc[num_reqs] == num_reqs:
            rows = None  # a pure decode batch: request i is row i
            block_table = metadata.block_table[:num_reqs]
            lens = metadata.seq_lens[:num_reqs]
        else:
            index_tensor = torch.tensor(indices, dtype=torch.int64, device=self.device)
            rows = torch.tensor([query_start_loc[i] for i in indices], dtype=torch.int64, device=self.device)
            block_table = metadata.block_table.index_select(0, index_tensor)
            lens = metadata.seq_lens.index_select(0, index_tensor)
        decode_lens = [seq_lens[i] for i in indices]
        max_seq_len = max(decode_lens)
        mask = None
        if min(decode_lens) < max_seq_len:
            positions = torch.arange(max_seq_len, device=self.device)
            mask = (positions[None, :] < lens.to(self.device)[:, None])[:, None, None, :]
        return DecodeGroup(rows, len(indices), block_table, mask, max_seq_len)

    # -- sliding windows ---------------------------------------------------------------------------

    def _windowed_plan(self, plan: TorchAttentionPlan, metadata: AttentionMetadata, block_size: int,
                       window: int) -> tuple[DecodeGroup | None, list[PrefillChunk]]:
        cached = plan.windowed.get(window)
        if cached is None:
            decode = plan.decode
            if decode is not None and decode.native_rows is None:  # the C++ kernel takes the window itself
                decode = self._plan_window_decodes(metadata, plan, block_size, window)
            prefills = [self._plan_window_prefill(chunk, block_size, window) for chunk in plan.prefills]
            cached = plan.windowed[window] = (decode, prefills)
        return cached

    def _plan_window_decodes(self, metadata: AttentionMetadata, plan: TorchAttentionPlan, block_size: int,
                             window: int) -> DecodeGroup:
        """Each decode's blocks from the one holding key ``seq_len - W`` on, and their mask."""
        group, indices = plan.decode, plan.decode_indices
        lens = [plan.seq_lens[i] for i in indices]
        first_blocks = [max(0, n - window) // block_size for n in lens]
        num_blocks = max(-(-n // block_size) - first for n, first in zip(lens, first_blocks))
        # [B, num_blocks] columns of each request's table row; those past its last block are
        # clamped into the table (block 0 or a stale id: finite, masked below).
        columns = torch.tensor(first_blocks, dtype=torch.int64)[:, None] + torch.arange(num_blocks)[None, :]
        columns = columns.clamp_(max=metadata.block_table.shape[1] - 1).to(self.device)
        requests = torch.tensor(indices, dtype=torch.int64, device=self.device)
        block_table = metadata.block_table.index_select(0, requests).gather(1, columns)
        first_positions = torch.tensor(first_blocks, dtype=torch.int64, device=self.device)[:, None] * block_size
        positions = first_positions + torch.arange(num_blocks * block_size, device=self.device)[None, :]
        seq_lens = torch.tensor(lens, dtype=torch.int64, device=self.device)[:, None]
        mask = (positions < seq_lens) & (positions >= seq_lens - window)  # [B, num_blocks * block_size]
        return DecodeGroup(group.rows, group.num_reqs, block_table, mask[:, None, None, :],
                           num_blocks * block_size)

    def _plan_window_prefill(self, chunk: PrefillChunk, block_size: int, window: int) -> PrefillChunk:
        query_len = chunk.end - chunk.start
        if chunk.context_len == 0 and window >= query_len:
            return chunk  # the window covers the whole causal triangle
        first_key = 0
        if chunk.context_len > 0:
            first_visible = max(0, chunk.context_len - window + 1)  # of the chunk's first token
            first_key = first_visible - first_visible % block_size
        key_positions = torch.arange(first_key, chunk.seq_len, device=self.device)[None, :]
        query_positions = torch.arange(chunk.context_len, chunk.seq_len, device=self.device)[:, None]
        mask = (key_positions <= query_positions) & (key_positions > query_positions - window)
        return PrefillChunk(chunk.start, chunk.end, chunk.request_index, chunk.context_len, chunk.seq_len,
                            mask[None, None], first_key)

    # ------------------------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        plan = metadata.backend_state
        if not isinstance(plan, TorchAttentionPlan):
            plan = metadata.backend_state = self.plan(metadata)
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # each [num_blocks, block_size, Hkv, D]
        self._write_kv(key, value, key_cache, value_cache, plan)
        output = query.new_empty(query.shape)
        if plan.num_actual_tokens < query.shape[0]:
            output[plan.num_actual_tokens:] = 0
        decode, prefills = plan.decode, plan.prefills
        if sliding_window is not None:
            decode, prefills = self._windowed_plan(plan, metadata, key_cache.shape[1], sliding_window)
        if decode is not None:
            if decode.native_rows is not None:
                # Reads each cached key/value once, straight through the block table.
                self.native_paged_attention(
                    query.contiguous(), kv_cache, output, decode.native_rows, decode.native_reqs,
                    metadata.query_start_loc, metadata.seq_lens, metadata.block_table.contiguous(), self.scale,
                    sliding_window or 0, logits_soft_cap or 0.0)
            else:
                self._decode(query, key_cache, value_cache, decode, output, logits_soft_cap)
        for chunk in prefills:
            self._prefill(query, key, value, key_cache, value_cache, chunk, metadata, output, logits_soft_cap)
        return output

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, plan: TorchAttentionPlan) -> None:
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        flat_shape = (num_slots, self.num_kv_heads, self.head_dim)
        new_keys, new_values = key[: plan.num_actual_tokens], value[: plan.num_actual_tokens]
        if plan.write_rows is not None:
            new_keys = new_keys.index_select(0, plan.write_rows)
            new_values = new_values.index_select(0, plan.write_rows)
        key_cache.view(flat_shape).index_copy_(0, plan.write_slots, new_keys.to(key_cache.dtype))
        value_cache.view(flat_shape).index_copy_(0, plan.write_slots, new_values.to(value_cache.dtype))

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                group: DecodeGroup, output: torch.Tensor, soft_cap: float | None) -> None:
        block_size = key_cache.shape[1]
        num_blocks = -(-group.max_seq_len // block_size)
        keys = self._gather_blocks(key_cache, group.block_table[:, :num_blocks], group.max_seq_len)
        values = self._gather_blocks(value_cache, group.block_table[:, :num_blocks], group.max_seq_len)
        keys, values = keys.to(query.dtype), values.to(query.dtype)
        q = query if group.rows is None else query.index_select(0, group.rows)
        q = q[: group.num_reqs]  # [B, Hq, D]
        # keys/values [B, S, Hkv, D] -> [B, Hkv, S, D] views
        out = self._attend(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), group.mask,
                           causal=False, soft_cap=soft_cap)
        out = out.squeeze(2)  # [B, Hq, D]
        if group.rows is None:
            output[: out.shape[0]] = out
        else:
            output.index_copy_(0, group.rows, out)

    def _gather_blocks(self, cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        # cache [num_blocks, block_size, Hkv, D]; block_table [B, n] -> [B, seq_len, Hkv, D]
        # Gathering whole blocks as rows of a 2-D view is a plain row copy (much faster on CPU
        # than index_select on the 4-D tensor).
        batch, num_blocks = block_table.shape
        rows = cache.view(cache.shape[0], -1)  # [num_blocks, block_size * Hkv * D]
        gathered = rows.index_select(0, block_table.reshape(-1))  # int32 ids are fine here
        return gathered.view(batch, num_blocks * cache.shape[1], self.num_kv_heads, self.head_dim)[:, :seq_len]

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor, chunk: PrefillChunk,
                 metadata: AttentionMetadata, output: torch.Tensor, soft_cap: float | None) -> None:
        q = query[chunk.start: chunk.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        if chunk.context_len == 0:
            k = key[chunk.start: chunk.end]  # [L, Hkv, D]
            v = value[chunk.start: chunk.end]
            if key_cache.dtype != query.dtype:  # the values the cache holds (module docstring)
                k, v = k.to(key_cache.dtype).to(query.dtype), v.to(value_cache.dtype).to(query.dtype)
        else:
            block_size = key_cache.shape[1]
            first_block = chunk.first_key // block_size
            num_blocks = -(-chunk.seq_len // block_size) - first_block
            block_table = metadata.block_table[chunk.request_index: chunk.request_index + 1,
                                               first_block: first_block + num_blocks]
            num_keys = chunk.seq_len - chunk.first_key
            k = self._gather_blocks(key_cache, block_table, num_keys)[0].to(query.dtype)  # [S, Hkv, D]
            v = self._gather_blocks(value_cache, block_table, num_keys)[0].to(query.dtype)
        out = self._attend(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), chunk.mask,
                           causal=chunk.mask is None, soft_cap=soft_cap)
        output[chunk.start: chunk.end] = out[0].transpose(0, 1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, causal: bool, soft_cap: float | None = None) -> torch.Tensor:
        """q [B, Hq, L, D], k/v [B, Hkv, S, D], mask [B or 1, 1, L, S] bool or None; ``causal``
        only for S == L (torch aligns its causal mask top-left)."""
        if soft_cap is not None:
            return self._attend_soft_capped(q, k, v, mask, causal, soft_cap)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )

    def _attend_soft_capped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor | None, causal: bool, soft_cap: float) -> torch.Tensor:
        batch, num_heads, query_len, head_dim = q.shape
        num_kv_heads, num_keys = k.shape[1], k.shape[2]
        group = num_heads // num_kv_heads
        # Query head h uses kv head h // group: fold each kv head's query heads into its rows.
        grouped = q.reshape(batch, num_kv_heads, group * query_len, head_dim)
        scores = (grouped @ k.transpose(-1, -2)).float() * self.scale  # [B, Hkv, G * L, S]
        scores = (torch.tanh(scores / soft_cap) * soft_cap).view(batch, num_kv_heads, group, query_len, num_keys)
        if causal:
            mask = torch.ones(query_len, num_keys, dtype=torch.bool, device=q.device).tril()[None, None]
        if mask is not None:  # [B or 1, 1, L, S] -> [B or 1, 1, 1, L, S]
            scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype).view(batch, num_kv_heads, group * query_len, num_keys)
        return (probs @ v).view(batch, num_heads, query_len, head_dim)


def _host(host_copy: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor:
    return host_copy if host_copy is not None else tensor.cpu()
