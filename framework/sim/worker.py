"""The simulated device's worker: the far side of the real engine core, with a cost model where
the model's forward would be. It tracks each request's tokens from the scheduler output alone,
prices the step (``sparrow.sim.cost``), advances its simulated clock and "samples" a token id for
every request whose prompt is complete. No torch, no weights.

Token ids depend only on (seed, request id, position), never on the batch, so every scheduler of
an ablation sees the same sequences.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sparrow.config import EngineConfig
from sparrow.core.sched.output import SchedulerOutput
from sparrow.model_loader import model_hf_config
from sparrow.sim.cost import DTYPE_BYTES, NON_TORCH_BYTES, QUANTIZED_WEIGHT_BYTES, CostModel, ModelShape, StepCost
from sparrow.sim.platform import sim_settings
from sparrow.wire import ModelRunnerOutput

MASK64 = (1 << 64) - 1
# The tiny tokenizer keeps its special tokens at the top of the vocabulary: drawn ids stay below.
RESERVED_TOP_IDS = 16


def mix64(value: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread hash of a 64-bit integer."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


class _SimRequest:
    __slots__ = ("prompt_token_ids", "num_tokens", "token_seed")

    def __init__(self, prompt_token_ids: list[int], num_tokens: int, token_seed: int) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.num_tokens = num_tokens  # prompt + outputs known so far
        self.token_seed = token_seed


class SimWorker:
    def __init__(self, config: EngineConfig, platform: Any, rank: int = 0, local_rank: int = 0,
                 world_size: int = 1, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.platform = platform
        self.rank = rank
        self.settings = sim_settings(config.additional_config)
        self.block_size = config.cache.block_size or platform.default_block_size
        self.dtype = platform.resolve_dtype(config.model.dtype)
        self.shape: ModelShape | None = None
        self.cost: CostModel | None = None
        self.requests: dict[str, _SimRequest] = {}
        # The simulated clock: seconds of device time since the engine started.
        self.clock_s = 0.0
        self.num_steps = 0
        self.last_step: StepCost | None = None

    # -- start-up -------------------------------------------------------------------------------
    def init_device(self) -> None:
        pass

    def load_model(self) -> None:
        """Read the model's shapes from its config.json; no weights exist on this device."""
        model = self.config.model
        self.shape = ModelShape.from_hf_config(model_hf_config(model))
        quantization = self.config.model.quantization
        weight_bytes = QUANTIZED_WEIGHT_BYTES.get(quantization, DTYPE_BYTES[self.dtype]) if quantization \
            else DTYPE_BYTES[self.dtype]
        self.cost = CostModel(self.shape, self.settings.gpu, DTYPE_BYTES[self.dtype], weight_bytes,
                              self.settings.step_overhead_s, self.settings.token_overhead_s)
        self.vocab_limit = max(1, self.shape.vocab_size - RESERVED_TOP_IDS)

    def kv_bytes_per_block(self) -> int:
        assert self.cost is not None
        return self.block_size * self.cost.kv_bytes_per_token

    def available_kv_cache_bytes(self) -> int:
        """``gpu_memory_utilization`` of the card minus the weights, the activation peak of the
        largest step and the runtime's own memory, as the CUDA worker's profiling run finds them."""
        assert self.shape is not None and self.cost is not None
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        num_tokens = min(self.config.max_num_batched_tokens, self.config.model.max_model_len or 0)
        activations = self.shape.activation_peak_bytes(
            num_tokens, min(self.config.scheduler.max_num_seqs, num_tokens), DTYPE_BYTES[self.dtype])
        weights = self.shape.num_params * self.cost.weight_bytes
        return int(self.settings.gpu.memory_bytes * cache.gpu_memory_utilization - weights - activations
                   - NON_TORCH_BYTES)

    def determine_num_kv_blocks(self) -> int:
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        budget = self.available_kv_cache_bytes()
        num_blocks = budget // self.kv_bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"the simulated {self.settings.gpu.name}'s KV cache budget ({budget} bytes) holds no block of "
                f"{self.kv_bytes_per_block()} bytes; raise gpu_memory_utilization or lower max_num_batched_tokens")
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def kv_cache_groups(self) -> list[tuple[int | None, list[int]]]:
        assert self.shape is not None
        return [(None, list(range(self.shape.num_layers)))]

    def num_parameters(self) -> int:
        assert self.shape is not None
        return self.shape.num_params

    def sim_stats(self) -> dict[str, float]:
        """The simulated clock, for callers that reach the worker by ``collective_rpc``."""
        return {"clock_s": self.clock_s, "num_steps": self.num_steps}

    # -- steps ----------------------------------------------------------------------------------
    def _token_seed(self, req_id: str) -> int:
        digest = hashlib.blake2b(f"{self.config.model.seed}:{req_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def _next_token(self, request: _SimRequest) -> int:
        position = request.num_tokens
        if self.settings.tokens == "copy":
            prompt = request.prompt_token_ids
            return prompt[(position - len(prompt)) % len(prompt)]
        return mix64(request.token_seed ^ position) % self.vocab_limit

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.cost is not None
        requests = self.requests
        for req_id in scheduler_output.finished_req_ids:
            requests.pop(req_id, None)
        computed: dict[str, int] = {}  # req_id -> num_computed_tokens before this step
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids)
            requests[new.req_id] = _SimRequest(prompt, len(prompt) + len(new.output_token_ids),
                                               self._token_seed(new.req_id))
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        scheduled: list[tuple[int, int]] = []
        for req_id, num_new_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            num_computed = computed[req_id]
            scheduled.append((num_computed, num_new_tokens))
            req_ids.append(req_id)
            if num_computed + num_new_tokens >= request.num_tokens:  # the prompt is complete: sample
                token = self._next_token(request)
                request.num_tokens += 1
                sampled.append([token])
            else:
                sampled.append([])
        num_sampled = sum(1 for tokens in sampled if tokens)
        self.last_step = self.cost.step(scheduled, num_sampled)
        self.clock_s += self.last_step.duration_s
        self.num_steps += 1
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
