"""The attention contract between model code and platform backends.

A step is a flat batch: the new tokens of every scheduled request, concatenated in batch order
(prefill chunks and decodes mixed). The paged KV cache of one layer is a tensor
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0: keys, 1: values); token slot
``s`` lives at block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner and passed explicitly to every layer."""

    num_actual_tokens: int  # tokens in the step (inputs may be padded beyond this, e.g. CUDA graphs)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    # [num_reqs + 1] int32: request i's new tokens are rows query_start_loc[i]:query_start_loc[i+1]
    query_start_loc: torch.Tensor
    # [num_reqs] int32: tokens in context after this step (num_computed_tokens + num_new_tokens)
    seq_lens: torch.Tensor
    # [num_reqs, max_num_blocks_per_req] int32: physical block ids; unused tail entries are 0
    block_table: torch.Tensor
    # [num_tokens] int64: cache slot of each new token; -1 for padding tokens (not written)
    slot_mapping: torch.Tensor
    # Host copies of query_start_loc and seq_lens, for backends that loop or plan on the CPU.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    # True when every request has exactly one new token (a pure decode batch).
    is_decode_only: bool = False
    # Backend-private state (e.g. FlashInfer wrappers planned for this step).
    backend_state: Any = None
    # Hybrid KV cache (layers of several KV cache groups, e.g. sliding and global layers): one
    # metadata per group, index = the layer's ``kv_group``; each has its own ``block_table`` and
    # ``slot_mapping`` (and ``backend_state``). None when every layer is in one group (this one).
    groups: list[AttentionMetadata] | None = None
    # Which KV cache group this metadata describes (its index in ``groups``; 0 with one group).
    # Backends that keep per-step state across layers key it by group (FlashInfer's wrappers).
    kv_group: int = 0

    def for_group(self, kv_group: int) -> AttentionMetadata:
        """The metadata a layer of KV cache group ``kv_group`` attends with."""
        return self if self.groups is None else self.groups[kv_group]


class AttentionBackend(ABC):
    """One instance per worker, shared by every attention layer of the model.

    Causal semantics: new token j of request i sits at position
    ``seq_lens[i] - query_len_i + j`` and attends to every cached and new token of request i at a
    position <= its own.
    """

    name: str = "abstract"
    # Features a layer may ask for through ``forward``'s keyword arguments. A model whose layers
    # need one the backend lacks fails to build, naming the backend and the feature.
    supports_sliding_window: bool = False
    supports_logits_soft_cap: bool = False
    # Which steps a CUDA graph captured once may replay with other inputs (read by the CUDA
    # runner, sparrow_cuda.cuda_graphs): "always" when ``forward`` reads the step's layout from
    # the metadata's device tensors alone (any step, padded with empty requests and slot -1
    # tokens); "decode" for pure decode steps only; "never" when the backend plans on the host.
    graph_support: str = "never"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.dtype = dtype
        self.device = device

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called once per step before the forward (plan work shared by all layers)."""

    # Whether prepare_graph_step reads the step's layout on the host (metadata.query_start_loc_cpu,
    # seq_lens_cpu): a graph-capturing runner then keeps padded host copies beside its buffers.
    graph_needs_host_layout: bool = False

    def prepare_graph_step(self, metadata: AttentionMetadata, capturing: bool) -> None:  # noqa: B027
        """For a graph-capturing runner (sparrow_cuda.cuda_graphs), on a captured shape's static
        metadata: before its capture (``capturing``), and before each replay once the static
        buffers hold the (padded) step. A backend with ``graph_support`` "decode" that plans on the
        host re-plans here into the fixed buffers its captured kernels read."""

    @abstractmethod
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
        """Write the new keys and values into ``kv_cache`` at ``slot_mapping``, then attend.

        The keyword arguments are passed only when a layer uses them (so a backend that supports
        neither may leave them out of its signature): ``sliding_window`` W restricts each token at
        position p to the keys at positions ``p - W + 1 .. p``; ``logits_soft_cap`` c replaces each
        score s (after scaling) with ``c * tanh(s / c)``.
        """
