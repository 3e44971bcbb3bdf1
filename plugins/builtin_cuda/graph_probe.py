"""The probe step every captured family of CUDA graphs replays at start-up against the eager
forward (sparrow_cuda.cuda_graphs.StepGraphs): a small real step that a shape holds with room to
spare, so that its padding is exercised too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparrow.attention import AttentionMetadata

if TYPE_CHECKING:
    from sparrow_cuda.cuda_graphs import GraphShape


@dataclass(slots=True)
class ProbeStep:
    """A real step to check a family's replay with (see :func:`probe_step`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    token_slots: torch.Tensor | None


def probe_step(shape: GraphShape, *, block_size: int, num_blocks: int, max_blocks_per_req: int,
               max_model_len: int, vocab_size: int, device: torch.device) -> ProbeStep | None:
    """A step that ``shape`` holds with room to spare (fewer requests and tokens, so the padding
    is exercised): requests with cached context of different lengths (a block boundary crossed
    and not), query lengths of the family (decode: 1; verify: k + 1, 1 and k; mixed: a chunk
    beside decodes), on cache blocks 1.. (consecutive, unused at start-up), random token ids from
    a fixed seed; every token on adapter slot 0 for a LoRA shape. None when the cache is too small."""
    num_reqs = max(1, min(3, shape.num_reqs - 1))
    if shape.family == "decode":
        query_lens = [1] * num_reqs
    elif shape.family == "verify":
        q = shape.max_query_len
        query_lens = [q, 1, max(1, q - 1)][:num_reqs]
    else:
        budget = max(num_reqs, shape.num_tokens - 1)  # one padding token where the shape has room
        query_lens = [budget - (num_reqs - 1)] + [1] * (num_reqs - 1)
    contexts = [2 * block_size + 3, 5, block_size][:num_reqs]
    seq_lens = [min(c + q, max_model_len) for c, q in zip(contexts, query_lens)]
    contexts = [s - q for s, q in zip(seq_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    if sum(blocks_per_req) + 1 > num_blocks or max(blocks_per_req) > max_blocks_per_req or min(contexts) < 0:
        return None
    block_table = torch.zeros(num_reqs, max_blocks_per_req, dtype=torch.int32)
    slots, positions = [], []
    first = 1
    for row, (context, seq_len, count) in enumerate(zip(contexts, seq_lens, blocks_per_req)):
        block_table[row, :count] = torch.arange(first, first + count, dtype=torch.int32)
        first += count
        pos = torch.arange(context, seq_len)
        positions.append(pos)
        slots.append(block_table[row, pos // block_size].long() * block_size + pos % block_size)
    num_tokens = sum(query_lens)
    query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=num_reqs, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device), seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(device), slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens_t, is_decode_only=max(query_lens) == 1)
    return ProbeStep(input_ids=torch.randint(0, vocab_size, (num_tokens,), generator=generator).to(device),
                     positions=torch.cat(positions).to(device), metadata=metadata,
                     token_slots=torch.zeros(num_tokens, dtype=torch.int64, device=device) if shape.lora else None)
