"""CUDA model runner: the shared runner plus a profiling run and CUDA graphs for decode batches.

Decode steps are small and many, so host launch overhead dominates them. At start-up the runner
captures the model's forward once per batch size of a ladder (1, 2, 4, 8, 16, 24, 32, ... up to
max_num_seqs) on static input buffers; a pure-decode step is padded to the nearest captured size
and replayed. Prefill and mixed steps run eagerly. ``enforce_eager=True`` turns graphs off.

``kv_cache_dtype="fp8"`` stores the paged cache as float8_e4m3fn (half the bytes of bf16, so twice
the blocks in the same memory) with one key scale and one value scale per layer: read from the
checkpoint when it has them (``...layers.N.self_attn.k_scale`` / ``v_scale``, or one ``kv_scale``
for both, as fp8 exporters write them), else 1.0 (vLLM's default without calibration). The scales
reach the backend as the attention layers' ``k_scale`` / ``v_scale`` keywords.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import numpy as np
import torch

from sparrow.attention import AttentionMetadata
from sparrow.layers.attention import Attention
from sparrow.worker.model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)


# kv_cache_dtype -> the cache tensors' dtype ("auto": the model's).
KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# The names sparrow.models.llama's loader skips (IGNORED_SUFFIXES).
_KV_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


def checkpoint_kv_scales(model_dir: str | None) -> dict[int, tuple[float, float]]:
    """layer index -> (k_scale, v_scale) from the checkpoint's scale tensors; layers without
    any are left out (1.0). Only the matching tensors are read; no checkpoint (load_format
    dummy, or no directory) gives {}."""
    if model_dir is None:
        return {}
    from safetensors import safe_open

    from sparrow.model_loader import WeightFileError, safetensors_files

    try:
        files = safetensors_files(model_dir)
    except WeightFileError:
        return {}
    found: dict[int, dict[str, float]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                match = _KV_SCALE_NAME.search(name)
                if match is None:
                    continue
                tensor = handle.get_tensor(name).float()
                if tensor.numel() != 1:
                    raise ValueError(f"checkpoint tensor {name!r} is not a per-tensor scale "
                                     f"(shape {tuple(tensor.shape)}); the fp8 KV cache takes one scale per layer")
                value = float(tensor.reshape(()))
                if not value > 0 or value == float("inf"):
                    raise ValueError(f"checkpoint tensor {name!r} is not a positive finite scale: {value}")
                found.setdefault(int(match.group(1)), {})[match.group(2)] = value
    scales = {}
    for layer, named in found.items():
        both = named.get("kv_scale", 1.0)
        scales[layer] = (named.get("k_scale", both), named.get("v_scale", both))
    return scales


def apply_kv_scales(model: Any, scales: dict[int, tuple[float, float]]) -> int:
    """Give every attention layer its ``k_scale`` / ``v_scale`` keywords (1.0 where ``scales``
    has none); returns how many layers took a checkpoint scale."""
    applied = 0
    for module in model.modules():
        if isinstance(module, Attention):
            k_scale, v_scale = scales.get(module.layer_index, (1.0, 1.0))
            applied += module.layer_index in scales
            module.backend_kwargs.update(k_scale=k_scale, v_scale=v_scale)
    return applied


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 513, 16))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class CudaModelRunner(ModelRunner):
    pin_memory = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> captured decode forward
        self.graph_outputs: dict[int, torch.Tensor] = {}  # batch size -> [bs, hidden] static output
        self.graph_metadata: dict[int, AttentionMetadata] = {}
        self.static: dict[str, torch.Tensor] = {}
        self.kv_scales: dict[int, tuple[float, float]] = {}
        if self.config.cache.kv_cache_dtype != "auto":
            self._use_fp8_kv_cache(self.config.cache.kv_cache_dtype)

    def _use_fp8_kv_cache(self, name: str) -> None:
        backend = self.model.attn_backend
        if name not in getattr(type(backend), "supported_kv_cache_dtypes", ("auto",)):
            raise ValueError(f"kv_cache_dtype {name!r} is not supported by attention backend "
                             f"{getattr(backend, 'name', type(backend).__name__)!r}; use kv_cache_dtype='auto' "
                             "or another attention_backend")
        if self.device.type == "cuda":
            from sparrow_cuda.platform import check_fp8_kv_cache_capability

            try:
                check_fp8_kv_cache_capability(name, torch.cuda.get_device_capability(self.device))
            except ValueError as exc:
                raise ValueError(f"kv_cache_dtype: {exc}") from None
        self.kv_cache_dtype = KV_CACHE_TORCH_DTYPES[name]
        if hasattr(backend, "kv_cache_dtype"):  # FlashInfer plans for the cache dtype
            backend.kv_cache_dtype = self.kv_cache_dtype
        if self.config.load.load_format != "dummy":
            self.kv_scales = checkpoint_kv_scales(self.config.model.model)
        applied = apply_kv_scales(self.model, self.kv_scales)
        logger.info("KV cache in %s: %s", name, f"checkpoint scales for {applied} layers" if applied
                    else "per-tensor scales 1.0 (the checkpoint has none)")

    # -- host-to-device ---------------------------------------------------------------------
    def to_device(self, array: np.ndarray) -> torch.Tensor:
        # Off the step's main path (prepare_inputs fills persistent pinned buffers instead): grammar
        # masks, draft indices, a draft model's inputs. Pinned staging (from torch's caching host
        # allocator, which keeps the block until the copy ran) makes the copy asynchronous.
        host = torch.from_numpy(np.ascontiguousarray(array))
        return host.pin_memory().to(self.device, non_blocking=True)

    # -- memory profiling -------------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward with the largest step the scheduler can produce, plus the logits and a
        sampler-sized softmax, so the caller can read the activation peak."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec()
        num_blocks = -(-num_tokens // self.block_size) + 1
        caches = [torch.zeros(2, num_blocks, self.block_size, num_kv_heads, head_dim, dtype=self.kv_cache_dtype,
                              device=self.device) for _ in range(num_layers)]
        positions = torch.arange(num_tokens, device=self.device)
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens, max_seq_len=num_tokens,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_table=torch.arange(num_blocks - 1, dtype=torch.int32, device=self.device).unsqueeze(0),
            slot_mapping=positions.clone(),
            query_start_loc_cpu=torch.tensor([0, num_tokens], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([num_tokens], dtype=torch.int32),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        self.model.attn_backend.prepare(metadata)
        hidden = self.model.forward(input_ids, positions, caches, metadata)
        num_rows = min(self.max_num_reqs, num_tokens)
        logits = self.model.compute_logits(hidden[:num_rows])
        # The sampler holds a few [rows, vocab] float32 temporaries (softmax, sort for top-p).
        probs = logits.softmax(dim=-1)
        torch.sort(probs, dim=-1)
        del caches, hidden, logits, probs

    # -- CUDA graphs ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        if len(self.kv_cache_groups) > 1:
            # The static buffers hold one block table and one slot mapping; a hybrid cache has
            # one per group. Such models decode eagerly.
            logger.info("CUDA graphs off: the hybrid KV cache has %d groups", len(self.kv_cache_groups))
            return
        sizes = graph_batch_sizes(self.max_num_reqs)
        max_bs = sizes[-1]
        dev = self.device
        self.static = {
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "seq_lens": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            # The persistent device block table itself (sparrow.worker.input_buffers), updated
            # incrementally by prepare_inputs: a replay reads it with no copy. Rows past a step's
            # requests hold other rows' blocks; padding rows (seq_len 1, slot -1) discard them.
            "block_table": self.input_buffers().device_tables[0][:max_bs],
        }
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        try:
            for bs in reversed(sizes):  # largest first, so smaller graphs reuse its memory pool
                metadata = self._static_metadata(bs)
                for _ in range(2):  # warm-up (Triton autotuning, lazy inits) outside the capture
                    self._forward_static(bs, metadata)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self._forward_static(bs, metadata)
                self.graphs[bs] = graph
                self.graph_outputs[bs] = output
                self.graph_metadata[bs] = metadata
        except Exception as exc:  # noqa: BLE001 - graphs are an optimisation; eager always works
            logger.warning("CUDA graph capture failed, running eagerly: %r", exc)
            self.graphs.clear()
            self.graph_outputs.clear()
            self.graph_metadata.clear()
            return
        logger.info("captured %d CUDA graphs (batch sizes up to %d) in %.1fs", len(sizes), max_bs,
                    time.perf_counter() - started)

    def _static_metadata(self, bs: int) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(
            num_actual_tokens=bs, num_reqs=bs, max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc=s["query_start_loc"][: bs + 1], seq_lens=s["seq_lens"][:bs],
            block_table=s["block_table"][:bs], slot_mapping=s["slot_mapping"][:bs], is_decode_only=True,
        )

    def _forward_static(self, bs: int, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model.forward(self.static["input_ids"][:bs], self.static["positions"][:bs],
                                  self.kv_caches, metadata)

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        metadata = inputs.metadata
        num_reqs = metadata.num_reqs
        if not self.graphs or not metadata.is_decode_only or num_reqs > max(self.graphs):
            return super().run_model(inputs)
        bs = min(size for size in self.graphs if size >= num_reqs)
        s = self.static
        s["input_ids"][:num_reqs].copy_(inputs.input_ids)
        s["positions"][:num_reqs].copy_(inputs.positions)
        s["slot_mapping"][:num_reqs].copy_(metadata.slot_mapping)
        s["slot_mapping"][num_reqs:bs].fill_(-1)  # padding rows write nothing
        s["seq_lens"][:num_reqs].copy_(metadata.seq_lens)
        s["seq_lens"][num_reqs:bs].fill_(1)
        if metadata.block_table.data_ptr() != s["block_table"].data_ptr():  # not the persistent table
            width = metadata.block_table.shape[1]
            s["block_table"][:num_reqs, :width].copy_(metadata.block_table)
        self.graphs[bs].replay()
        return self.graph_outputs[bs][:num_reqs]
