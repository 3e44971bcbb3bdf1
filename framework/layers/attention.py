"""The attention layer of model code: a thin holder of the worker's attention backend.

Model code projects q/k/v and applies RoPE; this layer hands them, with the layer's own paged
KV cache and the step's metadata, to the backend, which writes the new keys and values into the
cache and attends. The backend is shared by every layer (one instance per worker).
"""

from __future__ import annotations

import torch
from torch import nn

from sparrow.attention import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, backend: AttentionBackend, layer_index: int) -> None:
        super().__init__()
        self.backend = backend
        self.layer_index = layer_index
        self.num_heads = backend.num_heads
        self.num_kv_heads = backend.num_kv_heads
        self.head_dim = backend.head_dim

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        return self.backend.forward(query, key, value, kv_cache, metadata)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_index}, backend={self.backend.name}, heads={self.num_heads}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        )
