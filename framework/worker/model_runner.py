"""The device-agnostic model runner: persistent batch -> flat inputs -> forward -> sample.

Platform plugins use it as is (CPU) or subclass it (CUDA: pinned buffers, CUDA graphs) by
overriding :meth:`ModelRunner.run_model` and the tensor-transfer helpers.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from sparrow.attention import AttentionMetadata
from sparrow.config import EngineConfig
from sparrow.core.kv_cache_utils import KVCacheGroupSpec, make_kv_cache_groups
from sparrow.core.sched.output import SchedulerOutput
from sparrow.layers.attention import Attention
from sparrow.sample.logits_processor.load import build_logits_processors
from sparrow.sample.metadata import SamplingTensors
from sparrow.sample.sampler import Sampler
from sparrow.spec_decode.proposer import build_proposer
from sparrow.spec_decode.worker import write_draft_tokens
from sparrow.utils.tensor_data import from_tensor_data
from sparrow.worker.deferred_tokens import DeferredStepOutput, PendingTokens, TokenCopies
from sparrow.worker.input_batch import CachedRequestState, InputBatch
from sparrow.worker.input_buffers import InputBuffers
from sparrow.worker.outputs import ModelRunnerOutput
from sparrow.worker.pooler import Pooler
from sparrow.worker.prompt_embeds import step_prompt_embeds
from sparrow.worker.sampling_step import SamplingStep

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepInputs:
    """One step's flat inputs; host arrays are numpy, device tensors torch."""

    __slots__ = ("input_ids", "positions", "metadata", "num_scheduled", "logits_indices", "complete_rows",
                 "grammar_bitmask", "draft_grammar_bitmask", "spec_decode_tokens", "prompt_embeds")

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 num_scheduled: np.ndarray, logits_indices: torch.Tensor, complete_rows: np.ndarray) -> None:
        self.input_ids = input_ids  # [T] int64
        self.positions = positions  # [T] int64
        self.metadata = metadata
        self.num_scheduled = num_scheduled  # [num_reqs] new tokens per row
        self.logits_indices = logits_indices  # [num_reqs] flat index of each row's last token
        self.complete_rows = complete_rows  # [num_reqs] bool: the row samples a token this step
        # Structured outputs: (rows [G] int64, bitmask [G, ceil(V / 32)] int32) on the device, or None.
        self.grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
        # The same for the draft positions a constrained request verifies: (indices [D'] into the
        # step's draft positions, flattened row by row in batch order; bitmask [D', words]), or None.
        self.draft_grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
        # Speculative decoding: req_id -> the drafts this step verifies (empty: none).
        self.spec_decode_tokens: dict[str, list[int]] = {}
        # Prompts given as embeddings: (flat positions [K] int64, rows [K, hidden]) on the device,
        # which replace the token embeddings there; None when no such prompt token is in the step.
        self.prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None


class ModelRunner(SamplingStep):
    # Whether host buffers may be pinned for host-to-device copies (the logits processors ask).
    pin_memory = False

    def __init__(self, config: EngineConfig, model: Any, device: torch.device, dtype: torch.dtype,
                 block_size: int, tp_rank: int = 0, platform: str | None = None) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        # The KV cache's storage dtype: the model's, unless a platform's runner stores it in
        # another (CUDA: float8_e4m3fn for kv_cache_dtype="fp8").
        self.kv_cache_dtype = dtype
        self.block_size = block_size
        self.tp_rank = tp_rank
        assert config.model.max_model_len is not None, "the engine's setup fills max_model_len"
        self.max_model_len: int = config.model.max_model_len
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_blocks_per_req = -(-self.max_model_len // block_size)
        self.vocab_size = model.vocab_size
        self.requests: dict[str, CachedRequestState] = {}  # req_id -> state, scheduled or not
        # Layers that share a block table; several groups when sliding-window and full-attention
        # layers are mixed (a hybrid cache). The engine core's KV cache manager asks for these.
        self.kv_cache_groups = assign_kv_cache_groups(model, self.max_model_len)
        self.batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_blocks_per_req,
                                num_kv_cache_groups=len(self.kv_cache_groups))
        # The built-in logits processors and those the configuration enables, built once.
        self.logits_processors = build_logits_processors(config, device, self.pin_memory)
        self.sampling_tensors = SamplingTensors(self.vocab_size, device, self.logits_processors)
        self._sampling_version = -1
        generator = torch.Generator(device=device)
        generator.manual_seed(config.model.seed)
        # The platform's top-k/top-p and draw ops (None: the torch references).
        self.sampler = Sampler(generator, platform, logprobs_mode=config.model.logprobs_mode)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_connector: Any = None  # worker half of a KV connector, set by the worker
        # Speculative decoding: the proposer (None: off). Requests speculate only when nothing
        # the verification cannot apply per position is in play (sparrow.spec_decode.proposer).
        self.plugin_logits_processors = bool(config.model.logits_processors)
        self.proposer = build_proposer(config.speculative.speculative_config, self)
        # Multi-LoRA: adapter slots and the hooks on the targeted layers (None: LoRA off, and the
        # model runs exactly as without it).
        self.lora_manager = build_lora_manager(config, model, device, dtype, platform)
        # Overlapped scheduling: the last step's sampled tokens while they are still on the device.
        self._pending: PendingTokens | None = None
        self.token_copies = TokenCopies(self.max_num_reqs, device)
        # Steps after a deferred one: how their inputs got its tokens ("identity" / "indexed":
        # fed on the device; "host": settled first). Read by tests and when profiling.
        self.feed_counts: collections.Counter[str] = collections.Counter()
        # A pooling model (runner="pooling") pools its prompts' hidden states instead of sampling.
        # A classifier (convert="classify") maps the pooled state through its score layer.
        self.pooler = Pooler(config.model.pooler_config["pooling_type"],
                             head=getattr(model, "score", None) if config.model.convert == "classify" else None) \
            if config.model.runner == "pooling" and config.model.pooler_config else None
        # Requests whose prompt came as embeddings (enable_prompt_embeds), while the worker holds them.
        self.embeds_req_ids: set[str] = set()
        if config.model.enable_prompt_embeds and not getattr(model, "supports_prompt_embeds", False):
            raise ValueError(f"enable_prompt_embeds: the model class {type(model).__name__} does not take prompt "
                             "embeddings (its forward has no prompt_embeds argument; see supports_prompt_embeds "
                             "in docs/plugins.md)")

    # -- KV cache ---------------------------------------------------------------------------
    def num_kv_cache_tensors(self) -> int:
        """Layer j of every KV cache group shares tensor j (the groups use disjoint block ids),
        so there are as many tensors as the largest group has layers: every layer with one group."""
        return max(len(group.layer_indices) for group in self.kv_cache_groups)

    def kv_cache_bytes_per_block(self) -> int:
        _, num_kv_heads, head_dim = self.model.kv_cache_spec()
        element_size = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        per_block = 2 * self.num_kv_cache_tensors() * self.block_size * num_kv_heads * head_dim * element_size
        # A draft model keeps as many blocks of its own (sparrow.spec_decode.draft_model): the budget holds both.
        return per_block + (self.proposer.kv_cache_bytes_per_block() if self.proposer is not None else 0)

    def kv_cache_fixed_bytes(self) -> int:
        """KV bytes that do not scale with the target's block count (a draft model's extra blocks)."""
        return self.proposer.kv_cache_fixed_bytes() if self.proposer is not None else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec()
        # each: [2, num_blocks, block_size, num_kv_heads, head_dim]
        tensors = [
            torch.zeros(2, num_blocks, self.block_size, num_kv_heads, head_dim, dtype=self.kv_cache_dtype,
                        device=self.device)
            for _ in range(self.num_kv_cache_tensors())
        ]
        # layer index -> its tensor: every layer is in exactly one group
        layer_tensors = {layer_index: tensors[position] for group in self.kv_cache_groups
                         for position, layer_index in enumerate(group.layer_indices)}
        self.kv_caches = [layer_tensors[layer_index] for layer_index in range(num_layers)]
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)

    # -- the step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._execute(scheduler_output, defer=False)
        assert isinstance(output, ModelRunnerOutput)
        return output

    def execute_model_deferred(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | DeferredStepOutput:
        """The step without waiting for its sampled tokens (overlapped scheduling): a
        :class:`DeferredStepOutput` whose ``result()`` waits, where the step samples plainly;
        the next step is fed the tokens on the device (sparrow.worker.deferred_tokens)."""
        return self._execute(scheduler_output, defer=True)

    @torch.inference_mode()
    def _execute(self, scheduler_output: SchedulerOutput, defer: bool) -> ModelRunnerOutput | DeferredStepOutput:
        feed, self._pending = self._pending, None
        if feed is not None and not (defer and feed.continues_in(scheduler_output)):
            feed.settle(self.batch)  # the host path: this step reads the tokens from the batch
            feed = None
            self.feed_counts["host"] += 1
        self.update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0 or self.batch.num_reqs == 0:
            return ModelRunnerOutput()
        inputs = self.prepare_inputs(scheduler_output)
        if feed is not None:
            query_start_loc = inputs.metadata.query_start_loc_cpu
            assert query_start_loc is not None  # prepare_inputs sets it
            self.feed_counts[feed.feed(self.batch, inputs.input_ids, query_start_loc.numpy(), self.to_device)] += 1
        inputs.grammar_bitmask, inputs.draft_grammar_bitmask = self.grammar_bitmask(scheduler_output)
        inputs.spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        connector_meta = scheduler_output.kv_connector_metadata
        if self.kv_connector is not None and connector_meta is not None:
            self.kv_connector.start_load_kv(self.kv_connector_meta(connector_meta))
        # Adapter tokens: the hooks read this step's token -> slot map (a platform's run_model may
        # replay a graph captured with them, sparrow_cuda.cuda_graphs).
        lora_step = self.lora_manager is not None and self.prepare_lora(inputs)
        try:
            hidden_states = self.run_model(inputs)  # [T, hidden]
        finally:
            if lora_step:
                self.lora_manager.finish_step()
        if self.kv_connector is not None and connector_meta is not None:
            self.kv_connector.save_kv(self.kv_connector_meta(connector_meta))
        if feed is not None:  # the forward is enqueued: the previous step's tokens may come home
            feed.settle(self.batch)
        if self.pooler is not None:
            pooled = self.pooler.pool(hidden_states, self.batch, inputs.num_scheduled, inputs.logits_indices,
                                      inputs.complete_rows)
            return ModelRunnerOutput(req_ids=list(self.batch.req_ids),
                                     sampled_token_ids=[[] for _ in self.batch.req_ids], pooler_output=pooled)
        return self.sample(hidden_states, inputs, defer=defer)

    def prepare_lora(self, inputs: StepInputs) -> bool:
        """Map this step's tokens to adapter slots; True when any token uses an adapter."""
        return self.lora_manager.prepare_step([state.lora_request for state in self.batch.states],
                                              inputs.num_scheduled, int(inputs.input_ids.shape[0]))

    def kv_connector_meta(self, meta: Any) -> Any:
        """Connector metadata as its own type (after a process hop it arrives as plain lists)."""
        meta_type = getattr(self.kv_connector, "metadata_type", None)
        if meta_type is not None and not isinstance(meta, meta_type):
            import msgspec

            return msgspec.convert(meta, meta_type)
        return meta

    def update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        if self.pooler is not None:  # finished, preempted or (re)started: nothing carried over
            self.pooler.forget([*so.finished_req_ids, *(new.req_id for new in so.scheduled_new_reqs)])
            for new in so.scheduled_new_reqs:
                self.pooler.begin(new.req_id, new.pooling_task)
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.embeds_req_ids.discard(req_id)
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove(new.req_id)  # a resumed request may still hold a stale row
            embeds = None
            if new.prompt_embeds is not None:
                embeds = from_tensor_data(new.prompt_embeds).to(self.dtype)
                self.embeds_req_ids.add(new.req_id)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=new.sampling_params, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, output_token_ids=list(new.output_token_ids),
                extra_group_block_ids=[list(block_ids) for block_ids in new.extra_group_block_ids],
                lora_request=new.lora_request, cache_salt=new.cache_salt, prompt_embeds=embeds,
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            state = self.requests[req_id]
            state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed
            row = batch.req_id_to_row.get(req_id)
            if row is not None:
                batch.append_blocks(row, new_block_ids)
                batch.num_computed_tokens[row] = num_computed
        for req_id, extra_group_block_ids in zip(cached.req_ids, cached.new_extra_group_block_ids):
            state = self.requests[req_id]
            for block_ids, new_block_ids in zip(state.extra_group_block_ids, extra_group_block_ids):
                block_ids.extend(new_block_ids)
            row = batch.req_id_to_row.get(req_id)
            if row is not None:
                batch.append_extra_group_blocks(row, extra_group_block_ids)
        scheduled = so.num_scheduled_tokens
        for req_id in [r for r in batch.req_ids if r not in scheduled]:
            batch.remove(req_id)  # kept in self.requests until it is scheduled again
        for req_id in scheduled:
            if req_id not in batch.req_id_to_row:
                batch.add(self.requests[req_id])
        if so.scheduled_spec_decode_tokens:
            write_draft_tokens(batch, so.scheduled_spec_decode_tokens)

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """The step's flat inputs, written into persistent buffers (sparrow.worker.input_buffers):
        the returned tensors are views that stay valid for this step and the next, no longer."""
        batch = self.batch
        num_reqs = batch.num_reqs
        num_scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in batch.req_ids), dtype=np.int64, count=num_reqs)
        total = int(num_scheduled.sum())
        step = self.input_buffers().prepare(num_scheduled, self.padded_num_tokens(total))
        metadata = AttentionMetadata(
            num_actual_tokens=total, num_reqs=num_reqs, max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len, query_start_loc=step.query_start_loc, seq_lens=step.seq_lens,
            block_table=step.block_tables[0], slot_mapping=step.slot_mappings[0],
            query_start_loc_cpu=step.query_start_loc_cpu, seq_lens_cpu=step.seq_lens_cpu,
            is_decode_only=total == num_reqs,
        )
        if len(step.block_tables) > 1:  # a hybrid KV cache: groups 1.. have their own tables and slots
            metadata.groups = [metadata] + [
                dataclasses.replace(metadata, block_table=table, slot_mapping=slots, kv_group=group)
                for group, (table, slots) in enumerate(zip(step.block_tables[1:], step.slot_mappings[1:]), start=1)
            ]
        prompt_embeds = step_prompt_embeds(batch, self.embeds_req_ids, num_scheduled, step.query_start_loc_cpu.numpy(),
                                           self.device) if self.embeds_req_ids else None
        batch.num_computed_tokens[:num_reqs] += num_scheduled
        inputs = StepInputs(
            input_ids=step.input_ids, positions=step.positions, metadata=metadata, num_scheduled=num_scheduled,
            logits_indices=step.logits_indices, complete_rows=step.complete_rows,
        )
        inputs.prompt_embeds = prompt_embeds
        return inputs

    # None: a separate device copy exactly when the device is not the CPU; tests set True on CPU
    # to run the copying path (pinned staging, incremental block tables) without a GPU.
    separate_device_buffers: bool | None = None

    def input_buffers(self) -> InputBuffers:
        """The persistent step buffers, made on first use (sized for the step token budget)."""
        buffers = getattr(self, "_input_buffers", None)
        if buffers is None:
            max_tokens = self.padded_num_tokens(self.config.max_num_batched_tokens)
            buffers = self._input_buffers = InputBuffers(self.batch, max_tokens, self.block_size, self.device,
                                                         separate_device=self.separate_device_buffers)
        return buffers

    def attention_metadata(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                           slot_mapping: np.ndarray) -> AttentionMetadata:
        """One KV cache group's metadata from host arrays: ``query_start_loc`` [num_reqs + 1] int32,
        ``seq_lens`` [num_reqs] int32, ``block_table`` [num_reqs, blocks] int32, ``slot_mapping``
        [T] int64 (T may exceed the real tokens: padding). Also how a draft model attends
        (sparrow.spec_decode.draft_model)."""
        num_reqs = int(seq_lens.shape[0])
        total = int(query_start_loc[-1])
        return AttentionMetadata(
            num_actual_tokens=total, num_reqs=num_reqs, max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=self.to_device(query_start_loc), seq_lens=self.to_device(seq_lens),
            block_table=self.to_device(block_table), slot_mapping=self.to_device(slot_mapping),
            query_start_loc_cpu=torch.from_numpy(query_start_loc), seq_lens_cpu=torch.from_numpy(seq_lens),
            is_decode_only=bool(total == num_reqs),
        )

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The step's token count after padding (subclasses bucket it); no padding here."""
        return num_tokens

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass; subclasses may replay a CUDA graph here."""
        self.prepare_attention(inputs.metadata)
        if inputs.prompt_embeds is not None:
            return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata,
                                      prompt_embeds=inputs.prompt_embeds)
        return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    def prepare_attention(self, metadata: AttentionMetadata) -> None:
        """The backend's per-step planning, once per KV cache group (each has its own tables)."""
        backend = self.model.attn_backend
        backend.prepare(metadata)
        for group_metadata in (metadata.groups or ())[1:]:
            backend.prepare(group_metadata)


def build_lora_manager(config: EngineConfig, model: Any, device: torch.device, dtype: torch.dtype,
                       platform: str | None) -> Any:
    lora = config.lora
    if not lora.enable_lora:
        return None
    from sparrow.lora.manager import LoRAManager

    return LoRAManager(model, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank,
                       max_cpu_loras=lora.max_cpu_loras, device=device, dtype=dtype, platform=platform)


def assign_kv_cache_groups(model: Any, max_model_len: int) -> list[KVCacheGroupSpec]:
    """Group the model's layers by their attention layers' sliding windows and set each
    attention layer's ``kv_group``. A model whose attention layers are not ``Attention`` modules
    numbered 0..num_layers-1 (a plugin's own) keeps one group of full-attention layers."""
    num_layers = model.kv_cache_spec()[0]
    layers = sorted((module for module in model.modules() if isinstance(module, Attention)),
                    key=lambda layer: layer.layer_index)
    if [layer.layer_index for layer in layers] != list(range(num_layers)):
        return [KVCacheGroupSpec(None, tuple(range(num_layers)))]
    groups = make_kv_cache_groups([layer.sliding_window for layer in layers], max_model_len)
    for group_id, group in enumerate(groups):
        for layer_index in group.layer_indices:
            layers[layer_index].kv_group = group_id
    if len(groups) > 1:
        logger.info("hybrid KV cache: %d groups of %d layers (sliding windows %s)", len(groups),
                    len(groups[0].layer_indices), [group.sliding_window for group in groups])
    return groups
