"""The cost model of the simulated device: one step's time from a roofline of the card.

A step reads the weights once (every scheduled token goes through every layer; an MoE layer reads
the experts its tokens route to), reads every scheduled request's KV context in attention and
writes the new tokens' KV; it computes ``2 x parameters`` FLOPs per token, the LM head's for each
row that samples, and attention's ``4 x heads x head_dim`` per (query, key) pair. The GPU time is
the larger of bytes / achievable bandwidth and FLOPs / achievable FLOP/s; the host adds a fixed
cost per step and a cost per sampled token, which is where an engine that does not overlap host
and device work loses time (the H100 run of docs/benchmarks.md spent about 12 ms per step beyond
its roofline). The overheads are calibrated once against that run (docs/benchmarks.md,
"Simulated device").

Shapes come from the model's config.json alone: nothing is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparrow.sim.gpus import GpuSpec

# The H100 run's measured device-to-device copy bandwidth (3,006 GB/s, docs/benchmarks.md) over
# the data sheet's 3.35 TB/s: the share of the peak a streaming kernel reaches.
BANDWIDTH_EFFICIENCY = 0.90
# Large bf16 GEMMs sustain about 60-70 % of the dense tensor-core peak (cuBLAS on H100 and A100);
# only prefill steps come near this limit.
COMPUTE_EFFICIENCY = 0.60
# Host overheads, calibrated against the H100 run (docs/benchmarks.md, "Simulated device"): the
# fixed part is the engine core's own step work measured at 256 requests (1.3-1.8 ms,
# scripts/bench_host_overhead.py) plus a CUDA-graph launch and the step's synchronisation; the
# per-token part is what remains of the measured elapsed time, spread over the sampled tokens (the
# sampler of that run reseeded and launched a kernel per seeded row).
STEP_OVERHEAD_S = 3.0e-3
TOKEN_OVERHEAD_S = 70e-6
# Memory the measured H100 run held besides the weights, the estimated activation peak and the KV
# cache (CUDA context, cuBLAS and Triton workspaces, graph pools): with it, the simulated H100 at
# gpu_memory_utilization=0.9 sizes the KV cache as the real run did (66.35 GiB, 38,825 blocks).
NON_TORCH_BYTES = round(2.49 * (1 << 30))

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per weight of a quantized checkpoint (scales and zero points neglected).
QUANTIZED_WEIGHT_BYTES = {"int8": 1.0, "fp8": 1.0, "awq": 0.5, "gptq": 0.5}


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0  # 0: dense MLP
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelShape:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = int(text.num_attention_heads)
        experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
        return cls(
            num_layers=int(text.num_hidden_layers), hidden_size=int(text.hidden_size), num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            intermediate_size=int(text.intermediate_size), vocab_size=int(text.vocab_size),
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            num_experts=experts,
            num_experts_per_tok=int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
            expert_intermediate_size=int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
            if experts else 0,
        )

    # -- parameter counts ---------------------------------------------------------------------
    @property
    def attention_params(self) -> int:  # q, k, v and o projections of one layer
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size

    @property
    def expert_params(self) -> int:  # gate, up and down of one expert (or of the dense MLP)
        inter = self.expert_intermediate_size if self.num_experts else self.intermediate_size
        return 3 * self.hidden_size * inter

    @property
    def num_params(self) -> int:
        per_layer = self.attention_params + self.expert_params * max(1, self.num_experts)
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def activation_peak_bytes(self, num_tokens: int, num_rows: int, dtype_bytes: int) -> int:
        """What the CUDA worker's profiling step peaks at beyond the weights: a few hidden-sized
        buffers, q/k/v, the MLP's gate-up output per token, and the sampler's float32 logits,
        probabilities and sort (values and int64 indices) per sampled row."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = self.expert_intermediate_size * max(1, self.num_experts_per_tok) if self.num_experts \
            else self.intermediate_size
        per_token = dtype_bytes * (4 * self.hidden_size + 2 * q_dim + 2 * kv_dim + 3 * inter)
        return num_tokens * per_token + num_rows * self.vocab_size * 20


@dataclass(slots=True)
class StepCost:
    """One simulated step, in seconds and the quantities they come from."""

    duration_s: float
    memory_s: float
    compute_s: float
    host_s: float
    bytes_read: float
    flops: float
    num_tokens: int
    num_reqs: int
    num_sampled: int


class CostModel:
    """Step times of one model on one card."""

    def __init__(self, shape: ModelShape, gpu: GpuSpec, dtype_bytes: int, weight_bytes: float | None = None,
                 step_overhead_s: float = STEP_OVERHEAD_S, token_overhead_s: float = TOKEN_OVERHEAD_S) -> None:
        self.shape = shape
        self.gpu = gpu
        self.step_overhead_s = step_overhead_s
        self.token_overhead_s = token_overhead_s
        self.weight_bytes = float(weight_bytes if weight_bytes is not None else dtype_bytes)  # per parameter
        self.kv_bytes_per_token = shape.kv_bytes_per_token(dtype_bytes)
        self.bandwidth = gpu.bandwidth_bytes_s * BANDWIDTH_EFFICIENCY
        self.flop_rate = gpu.flops * COMPUTE_EFFICIENCY
        # The LM head is read every step (tied or not); the embedding table is only gathered from.
        self._head_bytes = shape.vocab_size * shape.hidden_size * self.weight_bytes
        self._attention_bytes = shape.num_layers * shape.attention_params * self.weight_bytes
        self._expert_bytes = shape.num_layers * shape.expert_params * self.weight_bytes
        # Per token through the layers (active parameters: top-k experts of an MoE layer).
        active_experts = shape.num_experts_per_tok if shape.num_experts else 1
        self._layer_flops_per_token = 2 * shape.num_layers * (shape.attention_params
                                                              + shape.expert_params * active_experts)
        self._head_flops_per_row = 2 * shape.vocab_size * shape.hidden_size
        self._attention_flops_per_pair = 4 * shape.num_layers * shape.num_heads * shape.head_dim

    def weight_bytes_per_step(self, num_tokens: int) -> float:
        shape = self.shape
        experts = 1
        if shape.num_experts:  # a step touches at most the experts its tokens route to
            experts = min(shape.num_experts, num_tokens * shape.num_experts_per_tok)
        return self._attention_bytes + self._expert_bytes * experts + self._head_bytes

    def step(self, scheduled: list[tuple[int, int]], num_sampled: int) -> StepCost:
        """``scheduled``: (num_computed_tokens before the step, num_new_tokens) per request."""
        num_tokens = sum(new for _, new in scheduled)
        context_tokens = 0  # KV read by attention: every query reads its request's whole context
        pairs = 0  # causal (query, key) pairs
        for computed, new in scheduled:
            context_tokens += computed + new
            pairs += new * computed + new * (new + 1) // 2
        bytes_read = (self.weight_bytes_per_step(num_tokens)
                      + (context_tokens + num_tokens) * self.kv_bytes_per_token)  # + the new tokens' KV written
        flops = (num_tokens * self._layer_flops_per_token + num_sampled * self._head_flops_per_row
                 + pairs * self._attention_flops_per_pair)
        memory_s = bytes_read / self.bandwidth
        compute_s = flops / self.flop_rate
        host_s = self.step_overhead_s + num_sampled * self.token_overhead_s
        return StepCost(duration_s=max(memory_s, compute_s) + host_s, memory_s=memory_s, compute_s=compute_s,
                        host_s=host_s, bytes_read=bytes_read, flops=flops, num_tokens=num_tokens,
                        num_reqs=len(scheduled), num_sampled=num_sampled)
