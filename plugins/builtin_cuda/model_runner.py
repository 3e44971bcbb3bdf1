"""CUDA model runner: the shared runner plus a profiling run and CUDA graphs.

Small steps are many, and host launch overhead dominates them. At start-up the runner captures
the model's forward for decode, verification and mixed step shapes (sparrow_cuda.cuda_graphs,
which families depends on the attention backend) and replays the smallest that holds each step;
larger steps run eagerly. ``enforce_eager=True`` turns graphs off.

``kv_cache_dtype="fp8"`` stores the paged cache as float8_e4m3fn (half the bytes of bf16, so twice
the blocks in the same memory) with one key scale and one value scale per layer: read from the
checkpoint when it has them (``...layers.N.self_attn.k_scale`` / ``v_scale``, or one ``kv_scale``
for both, as fp8 exporters write them), else 1.0 (vLLM's default without calibration). The scales
reach the backend as the attention layers' ``k_scale`` / ``v_scale`` keywords.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import numpy as np
import torch

from sparrow.attention import AttentionMetadata
from sparrow.layers.attention import Attention
from sparrow.spec_decode.proposer import ProposerForward
from sparrow.worker.model_runner import ModelRunner, StepInputs
from sparrow_cuda.cuda_graphs import StaticInputs, StepGraphs, graph_shapes
from sparrow_cuda.graph_probe import probe_step

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


class CudaModelRunner(ModelRunner):
    pin_memory = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_graphs: StepGraphs | None = None  # captured forwards (None: eager)
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

    # -- CUDA graphs (sparrow_cuda.cuda_graphs) ---------------------------------------------
    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        self.step_graphs = self.build_step_graphs(pool=pool)
        if self.step_graphs is not None:
            self.step_graphs.capture()
        for forward in self.proposer.graph_forwards() if self.proposer is not None else ():
            graphs = self.build_proposer_graphs(forward, pool=pool)
            if graphs is not None and graphs.capture():
                forward.graphs = graphs

    def drop_cuda_graphs(self) -> None:
        """Forget every captured graph (sleep mode: they read memory that is about to move)."""
        self.step_graphs = None
        for forward in self.proposer.graph_forwards() if self.proposer is not None else ():
            forward.graphs = None

    def build_step_graphs(self, **graph_kwargs: Any) -> StepGraphs | None:
        """The step graphs this model and backend allow, not yet captured (None: eager only);
        ``graph_kwargs`` go to StepGraphs (tests pass a stand-in graph type to run on the CPU)."""
        if len(self.kv_cache_groups) > 1:
            # The static buffers hold one block table and one slot mapping; a hybrid cache has
            # one per group. Such models run eagerly.
            logger.info("CUDA graphs off: the hybrid KV cache has %d groups", len(self.kv_cache_groups))
            return None
        spec = self.config.speculative.speculative_config
        lora = self.lora_manager is not None
        return _step_graphs(
            self, "the model", self.model.attn_backend,
            lambda ids, positions, metadata: self.model.forward(ids, positions, self.kv_caches, metadata),
            self.input_buffers().device_tables[0], self.kv_caches[0].shape[1], self.max_model_len,
            num_speculative_tokens=spec["num_speculative_tokens"] if spec else 0,
            lora_state=self.lora_manager.state if lora else None, graph_kwargs=graph_kwargs)

    def build_proposer_graphs(self, forward: ProposerForward, **graph_kwargs: Any) -> StepGraphs | None:
        """Graphs for one of the speculative proposer's forwards (a draft model's or an EAGLE
        head's, over its own cache): decode steps (each drafted token) and, where the backend
        allows, mixed ones (the catch-up over new tokens); None when its backend has none."""
        if not forward.cache.kv_caches:
            return None
        table = torch.zeros(self.max_num_reqs, forward.max_blocks_per_req, dtype=torch.int32, device=self.device)
        return _step_graphs(self, forward.name, forward.model.attn_backend, forward.forward, table,
                            forward.cache.kv_caches[0].shape[1], forward.max_len,
                            max_blocks_per_req=forward.max_blocks_per_req, extras=forward.extras,
                            graph_kwargs=graph_kwargs)

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        graphs = self.step_graphs
        metadata = inputs.metadata
        lora_state = self.lora_manager.state if self.lora_manager is not None else None
        lora = lora_state is not None and lora_state.active
        # A graph embeds token ids only: a step with prompt embeddings runs eagerly.
        shape = None if graphs is None or inputs.prompt_embeds is not None else graphs.select(
            metadata.num_actual_tokens, metadata.num_reqs, metadata.max_query_len, lora)
        if shape is None:
            if graphs is not None:
                graphs.replays["eager"] += 1
            return ModelRunner.run_model(self, inputs)
        return graphs.replay(shape, inputs.input_ids, inputs.positions, metadata,
                             lora_state.token_slots if lora else None)


def _step_graphs(runner: ModelRunner, what: str, backend: Any, forward: Any, block_table: torch.Tensor,
                 num_blocks: int, max_len: int, *, num_speculative_tokens: int = 0, lora_state: Any = None,
                 max_blocks_per_req: int | None = None, extras: Any = (),
                 graph_kwargs: dict[str, Any]) -> StepGraphs | None:
    """StepGraphs (not yet captured) for ``forward`` over a cache of ``num_blocks`` blocks with the
    families ``backend`` allows; None when it allows none."""
    support = backend.graph_support
    if support == "never":
        logger.info("CUDA graphs off for %s: attention backend %r plans its steps on the host", what,
                    getattr(backend, "name", type(backend).__name__))
        return None
    host_layout = backend.graph_needs_host_layout
    if host_layout and getattr(backend, "block_size", 0) is None:
        backend.block_size = runner.block_size  # FlashInfer plans a graph's pages before its capture
    shapes = graph_shapes(support, runner.max_num_reqs, runner.config.max_num_batched_tokens,
                          num_speculative_tokens=num_speculative_tokens, lora=lora_state is not None)
    static = StaticInputs(max(s.num_tokens for s in shapes), max(s.num_reqs for s in shapes), block_table,
                          runner.device, lora=lora_state is not None, host_layout=host_layout, extras=extras)
    probe = functools.partial(
        probe_step, block_size=runner.block_size, num_blocks=num_blocks,
        max_blocks_per_req=max_blocks_per_req or runner.max_num_blocks_per_req, max_model_len=max_len,
        vocab_size=runner.vocab_size, device=runner.device)
    return StepGraphs(shapes, static, max_len, forward, lora_state, probe=probe,
                      prepare_graph_step=backend.prepare_graph_step, what=what, **graph_kwargs)
