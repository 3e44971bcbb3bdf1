"""Attention backends of the CUDA platform: Triton kernels (default) and FlashInfer (optional).

Both write the step's new keys/values with the Triton ``reshape_and_cache`` kernel and then attend
over the paged cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. Both read an fp8 cache
(``kv_cache_dtype="fp8"``: float8_e4m3fn, told by the cache tensor's dtype) with the layer's
``k_scale`` / ``v_scale`` keywords, which the CUDA model runner sets on every attention layer. Heavy imports
(triton, flashinfer) happen when a backend is constructed, so importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparrow.attention import AttentionBackend, AttentionMetadata

_FLASHINFER_WORKSPACE_BYTES = 256 * 1024 * 1024
# kv_cache_dtype values both backends serve ("fp8" and "fp8_e4m3" are float8_e4m3fn caches).
FP8_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _empty_output(query: torch.Tensor) -> torch.Tensor:
    # query may be a strided view of a fused qkv tensor; the output is always dense.
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


class TritonAttentionBackend(AttentionBackend):
    """One unified Triton kernel for the mixed prefill/decode batch; nothing to plan per step."""

    name = "triton"
    supports_sliding_window = True
    supports_logits_soft_cap = True
    # One kernel reads the whole layout from device tensors; tiles and splits depend on
    # max_query_len / max_seq_len only for speed (unified_paged_attention).
    graph_support = "always"
    supported_kv_cache_dtypes = FP8_KV_CACHE_DTYPES

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, dtype, device)
        from sparrow_cuda import triton_ops  # needs triton; imported only when chosen

        self._ops = triton_ops

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
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows past the last request unset
        self._ops.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        out = _empty_output(query)
        self._ops.unified_paged_attention(
            query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_table, self.scale, metadata.max_query_len, metadata.max_seq_len,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale)
        return out


@dataclass(slots=True)
class _FlashInferPlan:
    """What ``prepare`` planned for one step (kept in ``metadata.backend_state``)."""

    # (sliding_window, logits_soft_cap) -> the BatchPrefill/BatchDecode wrapper planned with them
    wrappers: dict[tuple[int | None, float | None], Any]
    page_size: int
    num_tokens: int  # rows of query the wrappers were planned for
    owner: int  # id() of the backend that planned it
    is_decode_only: bool
    # The plan() arguments every variant shares: (positional, keyword) for the chosen wrapper kind.
    plan_args: tuple[tuple, dict]
    kv_group: int = 0  # the KV cache group whose block table was planned
    kv_dtype: torch.dtype | None = None  # the cache dtype the wrappers were planned for
    graph_batch_size: int | None = None  # a CUDA graph's decode plan: its wrappers are that size's


def paged_kv_layout(
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32, on the device
    seq_lens_cpu: torch.Tensor,  # [num_reqs] int32
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table from our block table.

    Returns ``(paged_kv_indptr [num_reqs + 1] int32 on CPU, paged_kv_indices [total_pages] int32 on
    block_table's device, paged_kv_last_page_len [num_reqs] int32 on CPU)``.
    """
    seq_lens_cpu = seq_lens_cpu.to(torch.int32)
    num_reqs = seq_lens_cpu.shape[0]
    pages_per_req = (seq_lens_cpu + page_size - 1) // page_size  # [num_reqs]
    indptr = torch.zeros(num_reqs + 1, dtype=torch.int32)
    torch.cumsum(pages_per_req, dim=0, out=indptr[1:])
    # Tokens in the last page: 1..page_size for a non-empty request, 0 for an empty one.
    last_page_len = torch.where(pages_per_req > 0, seq_lens_cpu - (pages_per_req - 1) * page_size,
                                torch.zeros_like(seq_lens_cpu))
    # page k of the flat list belongs to request req_of_page[k], at column k - indptr[req].
    req_of_page = torch.repeat_interleave(torch.arange(num_reqs), pages_per_req.long())
    col_of_page = torch.arange(int(indptr[-1])) - indptr[req_of_page].long()
    device = block_table.device
    indices = block_table[req_of_page.to(device, non_blocking=True),
                          col_of_page.to(device, non_blocking=True)].to(torch.int32)
    return indptr, indices, last_page_len


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer paged attention: a prefill (append) wrapper for mixed batches and a decode
    wrapper for pure decode batches, planned once per step and reused by every layer.

    The page size is the cache's block size. Pass ``block_size`` to plan in :meth:`prepare`;
    without it the plan is made by the first layer's :meth:`forward` of the step, when the cache's
    shape is known. Planning runs on the host, so steps are not CUDA-graph capturable
    (``graph_support = "never"``).

    Layers with a sliding window or logit soft-capping need wrappers planned with them
    (``window_left = W - 1``, ``logits_soft_cap``): one pair of wrappers per distinct
    (window, soft cap), made on first use and planned by the step's first layer that needs it.
    A hybrid KV cache (``metadata.groups``) plans each group's block table separately, so wrappers
    are kept per (KV cache group, window, soft cap): one group's plan never replaces another's.
    They share the workspace, as the prefill and decode wrappers do: their runs are sequential on
    one stream.
    """

    name = "flashinfer"
    supports_sliding_window = True
    supports_logits_soft_cap = True
    # Decode steps replay CUDA graphs of wrappers made for them (use_cuda_graph, fixed buffers per
    # batch size), re-planned on the host from the padded step before every replay
    # (prepare_graph_step). Mixed steps plan a prefill wrapper per step and run eagerly.
    graph_support = "decode"
    graph_needs_host_layout = True
    supported_kv_cache_dtypes = FP8_KV_CACHE_DTYPES

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device, *, block_size: int | None = None,
                 workspace_bytes: int = _FLASHINFER_WORKSPACE_BYTES) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, dtype, device)
        try:
            import flashinfer
        except ImportError as exc:
            raise ImportError(
                "the 'flashinfer' attention backend needs FlashInfer: "
                "pip install sparrow-llm[flashinfer]") from exc
        from sparrow_cuda import triton_ops

        self._flashinfer = flashinfer
        self._ops = triton_ops
        self.block_size = block_size
        # The cache dtype plans made in prepare() assume; the CUDA runner sets float8_e4m3fn for an
        # fp8 cache (forward re-plans if the cache it gets differs).
        self.kv_cache_dtype = dtype
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        # (kv_group, sliding_window, logits_soft_cap) -> (prefill wrapper, decode wrapper)
        self._wrappers: dict[tuple[int, int | None, float | None], tuple[Any, Any]] = {}
        # CUDA graphs of decode steps: (batch size, sliding_window, logits_soft_cap) -> a decode
        # wrapper in FlashInfer's graph mode, planned into fixed buffers of that batch size.
        self._graph_wrappers: dict[tuple[int, int | None, float | None], Any] = {}
        self._max_pages_per_req = 0  # the block table's width, read by prepare_graph_step

    def _wrapper_pair(self, variant: tuple[int, int | None, float | None]) -> tuple[Any, Any]:
        pair = self._wrappers.get(variant)
        if pair is None:
            flashinfer = self._flashinfer
            prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            # Tensor cores pay off for decode once a kv head serves several query heads.
            decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=self.num_heads // self.num_kv_heads > 4)
            pair = self._wrappers[variant] = (prefill, decode)
        return pair

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.backend_state = None
        if self.block_size is not None:
            metadata.backend_state = self._plan(metadata, self.block_size, self.kv_cache_dtype)

    def prepare_graph_step(self, metadata: AttentionMetadata, capturing: bool) -> None:
        """A decode graph's plan (sparrow_cuda.cuda_graphs): made before the capture, and made
        again before each replay into the same wrappers' fixed buffers (every variant the capture
        used), from the padded step's host layout. Padding requests (seq_len 0) are planned as one
        key of their table row's first block, so every request has a page (outputs unread)."""
        if not metadata.is_decode_only:
            raise ValueError("FlashInfer CUDA graphs serve decode steps only")
        if self.block_size is None:
            raise ValueError("FlashInfer CUDA graphs need the block size when the backend is built")
        self._max_pages_per_req = metadata.block_table.shape[1]
        plan = self._plan(metadata, self.block_size, self.kv_cache_dtype, graph=True)
        if not capturing:
            for (size, *variant), _ in list(self._graph_wrappers.items()):
                if size == metadata.num_reqs:
                    self._planned_wrapper(plan, (variant[0], variant[1]))
        metadata.backend_state = plan

    def _plan(self, metadata: AttentionMetadata, page_size: int, kv_dtype: torch.dtype,
              graph: bool = False) -> _FlashInferPlan:
        num_reqs = metadata.num_reqs
        seq_lens_cpu = (metadata.seq_lens_cpu if metadata.seq_lens_cpu is not None
                        else metadata.seq_lens.cpu())[:num_reqs]
        if graph:
            seq_lens_cpu = seq_lens_cpu.clamp(min=1)
        qo_indptr_cpu = (metadata.query_start_loc_cpu if metadata.query_start_loc_cpu is not None
                         else metadata.query_start_loc.cpu())[:num_reqs + 1].to(torch.int32)
        kv_indptr, kv_indices, last_page_len = paged_kv_layout(
            metadata.block_table[:num_reqs], seq_lens_cpu, page_size)
        common = dict(q_data_type=self.dtype, kv_data_type=kv_dtype, sm_scale=self.scale)
        if metadata.is_decode_only:
            plan_args = ((kv_indptr, kv_indices, last_page_len, self.num_heads, self.num_kv_heads,
                          self.head_dim, page_size), common)
        else:
            # Causal masks in FlashInfer align the last query row with the last key, which is
            # exactly our "token j sits at seq_len - query_len + j" rule for chunks after context.
            plan_args = ((qo_indptr_cpu, kv_indptr, kv_indices, last_page_len, self.num_heads,
                          self.num_kv_heads, self.head_dim, page_size), dict(common, causal=True))
        plan = _FlashInferPlan(wrappers={}, page_size=page_size,
                               num_tokens=num_reqs if graph else int(qo_indptr_cpu[-1]),
                               owner=id(self), is_decode_only=metadata.is_decode_only, plan_args=plan_args,
                               kv_group=metadata.kv_group, kv_dtype=kv_dtype,
                               graph_batch_size=num_reqs if graph else None)
        # Wrappers are planned by the first layer that runs each variant (see _planned_wrapper).
        return plan

    def _planned_wrapper(self, plan: _FlashInferPlan, variant: tuple[int | None, float | None]) -> Any:
        """The wrapper of ``variant`` planned for this step (planned now on first use)."""
        wrapper = plan.wrappers.get(variant)
        if wrapper is None:
            if plan.graph_batch_size is not None:
                wrapper = self._graph_wrapper(plan, variant)
            else:
                prefill, decode = self._wrapper_pair((plan.kv_group, *variant))
                wrapper = decode if plan.is_decode_only else prefill
            sliding_window, soft_cap = variant
            args, kwargs = plan.plan_args
            # window_left = W - 1 keys before the query's own. Pages wholly before the window stay
            # listed (a freed block's entry names block 0 or a reused block: finite values), and
            # FlashInfer masks their keys.
            wrapper.plan(*args, **kwargs, window_left=-1 if sliding_window is None else sliding_window - 1,
                         logits_soft_cap=soft_cap)
            plan.wrappers[variant] = wrapper
        return wrapper

    def _graph_wrapper(self, plan: _FlashInferPlan, variant: tuple[int | None, float | None]) -> Any:
        """The graph-mode decode wrapper of the plan's batch size and ``variant``, made on first
        use with fixed index buffers (as many pages as the block table holds per request)."""
        size = plan.graph_batch_size
        assert size is not None
        wrapper = self._graph_wrappers.get((size, *variant))
        if wrapper is None:
            indices = plan.plan_args[0][1]  # the planned pages (the buffer holds at least as many)
            max_pages = size * self._max_pages_per_req
            device = self._workspace.device
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.num_heads // self.num_kv_heads > 4,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(max(max_pages, int(indices.shape[0])), dtype=torch.int32,
                                                    device=device),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device))
            self._graph_wrappers[(size, *variant)] = wrapper
        return wrapper

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
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows past the last request unset
        page_size = kv_cache.shape[2]
        plan = metadata.backend_state
        if (not isinstance(plan, _FlashInferPlan) or plan.owner != id(self)
                or plan.page_size != page_size or plan.kv_dtype != kv_cache.dtype):
            plan = self._plan(metadata, page_size, kv_cache.dtype)
            metadata.backend_state = plan
        self._ops.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        out = _empty_output(query)
        rows = plan.num_tokens
        # NHD pages: each of (k_cache, v_cache) is [num_blocks, block_size, num_kv_heads, head_dim].
        wrapper = self._planned_wrapper(plan, (sliding_window, logits_soft_cap))
        # fp8 pages: FlashInfer dequantizes with the per-tensor scales (stored * scale).
        scales = {"k_scale": k_scale, "v_scale": v_scale} if kv_cache.dtype.itemsize == 1 else {}
        wrapper.run(query[:rows].contiguous(), (kv_cache[0], kv_cache[1]), out=out[:rows], **scales)
        return out
