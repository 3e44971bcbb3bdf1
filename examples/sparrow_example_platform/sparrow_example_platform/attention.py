"""Gather-then-SDPA attention: the simplest correct paged attention, one request at a time.

Per layer and step:

1. write: each new token's key and value go to its cache slot, ``slot_mapping[t]`` =
   ``block * block_size + offset`` (padding tokens, slot -1, are skipped);
2. attend, request by request: the request's blocks are gathered through its block-table row into
   a contiguous ``[seq_len, num_kv_heads, head_dim]`` tensor (which now includes this step's
   tokens), and one ``scaled_dot_product_attention`` call covers its new tokens.

The built-in cpu backend batches every decode into one padded call; this one trades that speed
for code a vendor can read in a minute and then replace with a device kernel. The per-request
split is planned once per step in ``prepare`` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sparrow.attention import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class RequestSlice:
    """One request's new tokens in the flat batch and what they attend to."""

    row: int  # the request's row in block_table
    start: int  # its new tokens are flat rows start:end
    end: int
    seq_len: int  # cached + new tokens after this step
    # [end - start, seq_len] bool (True: attend) when the request has cached context and more than
    # one new token; None when SDPA's own modes suffice (see ``is_causal``)
    mask: torch.Tensor | None
    # True for a prefill with no cached context (plain causal); False for a single new token,
    # which attends to every position.
    is_causal: bool


@dataclass(slots=True)
class SdpaPlan:
    valid_rows: torch.Tensor | None  # [N] int64 flat rows that are written, None: all actual rows
    slots: torch.Tensor  # [N] int64 cache slots of those rows
    num_actual_tokens: int
    requests: list[RequestSlice] = field(default_factory=list)


class GatherSdpaAttention(AttentionBackend):
    name = "sdpa"

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.backend_state = self._plan(metadata)

    def _plan(self, metadata: AttentionMetadata) -> SdpaPlan:
        starts = _on_host(metadata.query_start_loc_cpu, metadata.query_start_loc).tolist()
        seq_lens = _on_host(metadata.seq_lens_cpu, metadata.seq_lens).tolist()
        requests = []
        for row in range(metadata.num_reqs):
            start, end, seq_len = starts[row], starts[row + 1], seq_lens[row]
            query_len = end - start
            if query_len == 0:
                continue
            if query_len > seq_len:
                raise ValueError(f"seq_lens[{row}] = {seq_len} is smaller than the request's {query_len} new tokens")
            context_len = seq_len - query_len
            mask = None
            if query_len > 1 and context_len > 0:
                # new token j sits at position context_len + j and sees keys at positions <= its own
                key_positions = torch.arange(seq_len, device=self.device)
                query_positions = torch.arange(context_len, seq_len, device=self.device)
                mask = key_positions[None, :] <= query_positions[:, None]
            requests.append(RequestSlice(row, start, end, seq_len, mask,
                                         is_causal=query_len > 1 and context_len == 0))
        slots = metadata.slot_mapping[: metadata.num_actual_tokens].to(torch.int64)
        valid = slots >= 0
        valid_rows = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        if valid_rows is not None:
            slots = slots.index_select(0, valid_rows)
        return SdpaPlan(valid_rows, slots, metadata.num_actual_tokens, requests)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        plan = metadata.backend_state
        if not isinstance(plan, SdpaPlan):  # called without prepare (e.g. a unit test)
            plan = metadata.backend_state = self._plan(metadata)
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        block_size = key_cache.shape[1]
        self._write(key, value, key_cache, value_cache, plan)

        output = torch.zeros_like(query)  # padding rows beyond num_actual_tokens stay zero
        group = self.num_heads // self.num_kv_heads
        for req in plan.requests:
            num_blocks = -(-req.seq_len // block_size)
            block_ids = metadata.block_table[req.row, :num_blocks].to(torch.int64)
            keys = _gather(key_cache, block_ids, req.seq_len)  # [S, Hkv, D]
            values = _gather(value_cache, block_ids, req.seq_len)
            q = query[req.start: req.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
            # GQA: each KV head serves `group` consecutive query heads -> [1, Hq, S, D]
            k = keys.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            v = values.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=req.mask, is_causal=req.is_causal,
                                                 scale=self.scale)
            output[req.start: req.end] = out[0].transpose(0, 1)
        return output

    @staticmethod
    def _write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               plan: SdpaPlan) -> None:
        block_size = key_cache.shape[1]
        new_keys, new_values = key[: plan.num_actual_tokens], value[: plan.num_actual_tokens]
        if plan.valid_rows is not None:
            new_keys, new_values = new_keys[plan.valid_rows], new_values[plan.valid_rows]
        blocks, offsets = plan.slots // block_size, plan.slots % block_size
        key_cache[blocks, offsets] = new_keys
        value_cache[blocks, offsets] = new_values


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] cache, [n] block ids -> [seq_len, Hkv, D] contiguous."""
    blocks = cache.index_select(0, block_ids)  # [n, block_size, Hkv, D]
    return blocks.flatten(0, 1)[:seq_len]


def _on_host(host_copy: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor:
    return host_copy if host_copy is not None else tensor.cpu()
