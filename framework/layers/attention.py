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
    def __init__(self, backend: AttentionBackend, layer_index: int, *, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.layer_index = layer_index
        self.num_heads = backend.num_heads
        self.num_kv_heads = backend.num_kv_heads
        self.head_dim = backend.head_dim
        # Passed to the backend only when set, so backends without the feature keep working.
        self.backend_kwargs: dict[str, int | float] = {}
        for feature, value, supported in (
            ("sliding_window", sliding_window, backend.supports_sliding_window),
            ("logits_soft_cap", logits_soft_cap, backend.supports_logits_soft_cap),
        ):
            if value is None:
                continue
            if not supported:
                raise ValueError(f"attention backend {backend.name!r} does not support {feature} "
                                 f"(layer {layer_index} needs {feature}={value}); choose another "
                                 "attention_backend")
            self.backend_kwargs[feature] = value
        self.sliding_window = sliding_window
        # The KV cache group whose blocks this layer's cache rows live in (set by the model runner
        # for hybrid caches; 0 when every layer shares one block table).
        self.kv_group = 0

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if metadata.groups is not None:
            metadata = metadata.groups[self.kv_group]
        if self.backend_kwargs:
            return self.backend.forward(query, key, value, kv_cache, metadata, **self.backend_kwargs)
        return self.backend.forward(query, key, value, kv_cache, metadata)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_index}, backend={self.backend.name}, heads={self.num_heads}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            + "".join(f", {name}={value}" for name, value in self.backend_kwargs.items())
        )
