"""The attention check: the platform's backend against a float32 reference of paged attention.

Three steps through one paged cache, shaped the way the model runner builds them:

1. a fresh prefill (s0), the first chunk of a chunked prefill (s1), and a prefill whose first block
   is already in the cache (s2: a prefix-cache hit, written here as the prefix cache would find it);
2. a mixed batch: decodes of s0 and s2, the rest of s1's prompt after its cached chunk, a request
   whose first block is s2's own physical block (s3: a shared prefix hit) and a one-token prompt (s4);
3. a decode-only batch of all five.

Every step runs two "layers" (two caches, one ``prepare``), so state planned once per step must
serve every layer. Each new token's output is compared with softmax attention over its request's
history, and every token written so far must sit in the cache at its slot, in the documented layout
``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sparrow.attention import AttentionMetadata
from sparrow.conformance import ATTENTION_SHAPES

NUM_LAYERS = 2
NUM_BLOCKS = 48
# Tolerances of one attention output against the float32 reference, by the backend's dtype.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass(slots=True)
class PagedRequest:
    """One request: its whole key/value history (drawn up front) and its block table."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values) [total_len, Hkv, D]
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens already in the cache


def attention_check(ctx: Any, shape_name: str) -> tuple[str, str]:
    """(status, detail) of the platform's attention backend on one head shape."""
    num_heads, num_kv_heads, head_dim = ATTENTION_SHAPES[shape_name]
    backend_cls = ctx.attention_backend_cls(num_heads, num_kv_heads, head_dim)
    dtype, device = ctx.torch_dtype, ctx.torch_device
    backend = backend_cls(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, dtype, device)
    block_size = ctx.platform.default_block_size
    run = _Run(backend, block_size, dtype, device)
    return run.all_steps(backend_cls.__name__)


class _Run:
    def __init__(self, backend: Any, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.backend = backend
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.generator = torch.Generator().manual_seed(1234)
        self.caches = [torch.zeros(2, NUM_BLOCKS, block_size, backend.num_kv_heads, backend.head_dim,
                                   dtype=dtype, device=device) for _ in range(NUM_LAYERS)]
        # Physical blocks handed out in a scrambled order, so a backend that assumes contiguous
        # blocks fails.
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=self.generator).tolist()
        self.max_err = 0.0

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.dtype)

    def sequence(self, total_len: int, shared_prefix: PagedRequest | None = None) -> PagedRequest:
        layers = [(self.randn(total_len, self.backend.num_kv_heads, self.backend.head_dim),
                   self.randn(total_len, self.backend.num_kv_heads, self.backend.head_dim))
                  for _ in range(NUM_LAYERS)]
        seq = PagedRequest(layers)
        if shared_prefix is not None:  # the same first block, physically shared, same contents
            bs = self.block_size
            for index, (keys, values) in enumerate(layers):
                keys[:bs], values[:bs] = shared_prefix.layers[index][0][:bs], shared_prefix.layers[index][1][:bs]
            seq.blocks.append(shared_prefix.blocks[0])
            seq.num_cached = bs
        return seq

    def preload(self, seq: PagedRequest, num_tokens: int) -> None:
        """Write the first ``num_tokens`` of ``seq`` into the cache as the prefix cache left them."""
        self.grow(seq, num_tokens)
        slots = self.slots(seq, 0, num_tokens)
        for (keys, values), cache in zip(seq.layers, self.caches):
            flat = cache.view(2, -1, *cache.shape[3:])
            flat[0, slots.to(self.device)] = keys[:num_tokens].to(self.device)
            flat[1, slots.to(self.device)] = values[:num_tokens].to(self.device)
        seq.num_cached = num_tokens

    def grow(self, seq: PagedRequest, seq_len: int) -> None:
        while len(seq.blocks) * self.block_size < seq_len:
            seq.blocks.append(self.free_blocks.pop())

    def slots(self, seq: PagedRequest, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(seq.blocks, dtype=torch.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def all_steps(self, backend_name: str) -> tuple[str, str]:
        bs = self.block_size
        s0, s1, s2 = self.sequence(11), self.sequence(2 * bs + 5), self.sequence(bs + 7)
        self.preload(s2, bs)
        s3 = self.sequence(bs + 4, shared_prefix=s2)
        s4 = self.sequence(3)
        steps = [
            ("prefill, chunked prefill, prefix hit", [(s0, 9), (s1, 6), (s2, 5)]),
            ("mixed prefill/decode, shared prefix", [(s0, 1), (s1, 2 * bs - 6), (s2, 1), (s3, 3), (s4, 1)]),
            ("decode only", [(s0, 1), (s1, 1), (s2, 1), (s3, 1), (s4, 1)]),
        ]
        for step_index, (label, batch) in enumerate(steps, start=1):
            problem = self.step(batch)
            if problem is not None:
                return "FAIL", f"step {step_index} ({label}): {problem}"
        return "pass", (f"{len(steps)} steps (prefill, chunked prefill, prefix hits, mixed and decode-only "
                        f"batches), {NUM_LAYERS} layers, block size {bs}, max abs err {self.max_err:.1e} "
                        f"({backend_name})")

    def step(self, batch: list[tuple[PagedRequest, int]]) -> str | None:
        """Run one step of ``batch`` [(sequence, new tokens)] through every layer; a description
        of the first mismatch, or None."""
        query_lens = [num_new for _, num_new in batch]
        seq_lens = [seq.num_cached + num_new for seq, num_new in batch]
        for (seq, _), seq_len in zip(batch, seq_lens):
            self.grow(seq, seq_len)
        metadata = self.metadata(batch, query_lens, seq_lens)
        self.backend.prepare(metadata)
        num_tokens = sum(query_lens)
        for layer, cache in enumerate(self.caches):
            query = self.randn(num_tokens, self.backend.num_heads, self.backend.head_dim)
            key = torch.cat([seq.layers[layer][0][seq.num_cached: seq.num_cached + n] for seq, n in batch])
            value = torch.cat([seq.layers[layer][1][seq.num_cached: seq.num_cached + n] for seq, n in batch])
            out = self.backend.forward(query.to(self.device), key.to(self.device), value.to(self.device), cache,
                                       metadata)
            expected_shape = (num_tokens, self.backend.num_heads, self.backend.head_dim)
            if tuple(out.shape) != expected_shape:
                return f"layer {layer}: output shape {tuple(out.shape)}, expected {expected_shape}"
            problem = self.compare(layer, batch, query, out.detach().float().cpu())
            if problem is None:
                problem = self.check_cache(layer, batch, seq_lens)
            if problem is not None:
                return f"layer {layer}: {problem}"
        for seq, num_new in batch:
            seq.num_cached += num_new
        return None

    def metadata(self, batch: list[tuple[PagedRequest, int]], query_lens: list[int],
                 seq_lens: list[int]) -> AttentionMetadata:
        query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        max_blocks = max(len(seq.blocks) for seq, _ in batch)
        block_table = torch.zeros(len(batch), max_blocks, dtype=torch.int32)  # unused tail entries are 0
        for row, (seq, _) in enumerate(batch):
            block_table[row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        slot_mapping = torch.cat([self.slots(seq, seq.num_cached, seq.num_cached + n) for seq, n in batch])
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        return AttentionMetadata(
            num_actual_tokens=sum(query_lens), num_reqs=len(batch), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), query_start_loc=query_start_loc.to(self.device),
            seq_lens=seq_lens_t.to(self.device), block_table=block_table.to(self.device),
            slot_mapping=slot_mapping.to(self.device), query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens_t, is_decode_only=all(n == 1 for n in query_lens),
        )

    def compare(self, layer: int, batch: list[tuple[PagedRequest, int]], query: torch.Tensor,
                out: torch.Tensor) -> str | None:
        tolerance = TOLERANCE.get(self.dtype, 3e-2)
        row = 0
        for request, (seq, num_new) in enumerate(batch):
            keys, values = seq.layers[layer]
            for j in range(num_new):
                position = seq.num_cached + j
                expected = reference_attention(query[row].float(), keys[: position + 1].float(),
                                               values[: position + 1].float(), self.backend.scale)
                err = (out[row] - expected).abs().max().item()
                bound = tolerance * (1 + expected.abs().max().item())
                self.max_err = max(self.max_err, err)
                if not err <= bound:  # also catches NaN
                    return (f"request {request} new token {j} (position {position}, {num_new} new tokens, "
                            f"{seq.num_cached} cached): max abs err {err:.2e} > {bound:.1e}")
                row += 1
        return None

    def check_cache(self, layer: int, batch: list[tuple[PagedRequest, int]], seq_lens: list[int]) -> str | None:
        cache = self.caches[layer].cpu()
        flat = cache.view(2, -1, *cache.shape[3:])
        for request, ((seq, _), seq_len) in enumerate(zip(batch, seq_lens)):
            slots = self.slots(seq, 0, seq_len)
            keys, values = seq.layers[layer]
            if not (torch.equal(flat[0, slots], keys[:seq_len]) and torch.equal(flat[1, slots], values[:seq_len])):
                return (f"request {request}: the KV cache does not hold its keys/values at their slots "
                        f"(layout [2, num_blocks, block_size, num_kv_heads, head_dim], slot = block * block_size "
                        f"+ offset)")
        return None


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """query [Hq, D]; keys/values [S, Hkv, D] (every position the token may see) -> [Hq, D]."""
    group = query.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (k @ query.unsqueeze(-1)).squeeze(-1) * scale  # [Hq, S]
    return (scores.softmax(-1).unsqueeze(1) @ v).squeeze(1)
