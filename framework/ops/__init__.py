"""The custom-op registry: every hot op has a torch reference and per-platform implementations.

Importing this package is cheap (no torch): the catalog of op names is here, the layer base
classes are in :mod:`sparrow.ops.base` and binding in :mod:`sparrow.ops.binding`, imported on
first use of the names below.

A platform plugin registers implementations through ``sparrow_register_ops``::

    @hookimpl
    def sparrow_register_ops(register):
        register("rms_norm", "npu", "my_npu.ops:NpuRMSNorm")

Layer ops (``kind == "layer"``) are served by an :class:`~sparrow.ops.base.OpImpl` subclass,
bound once per layer after the weights load; function ops (``kind == "function"``, the sampler's
steps) by a function with the reference's signature, resolved once when the sampler is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One registered op of the kernel."""

    name: str
    kind: Literal["layer", "function"]
    reference: str  # "module:Name": the CustomOp layer class, or the torch reference function
    description: str
    # "module:function" giving conformance cases: cases(dtype, device) -> list[sparrow.ops.OpCase]
    cases: str | None = None


KERNEL_OPS: dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec("linear", "layer", "sparrow.layers.linear:LinearBase",
           "x @ W^T + b of every linear layer (column/row parallel, fused QKV and gate/up)",
           "sparrow.ops.cases:linear_cases"),
    OpSpec("embedding", "layer", "sparrow.layers.embedding:VocabParallelEmbedding",
           "token ids -> embedding rows", "sparrow.ops.cases:embedding_cases"),
    OpSpec("lm_head", "layer", "sparrow.layers.embedding:ParallelLMHead",
           "hidden states -> float32 vocabulary logits", "sparrow.ops.cases:lm_head_cases"),
    OpSpec("rms_norm", "layer", "sparrow.layers.layernorm:RMSNorm",
           "RMSNorm, and fused residual add + RMSNorm when given a residual", "sparrow.ops.cases:rms_norm_cases"),
    OpSpec("rotary_embedding", "layer", "sparrow.layers.rotary:RotaryEmbedding",
           "rotary position embedding of query and key (neox layout)", "sparrow.ops.cases:rotary_cases"),
    OpSpec("silu_and_mul", "layer", "sparrow.layers.activation:SiluAndMul",
           "silu(gate) * up of the fused gate/up output", "sparrow.ops.cases:silu_and_mul_cases"),
    OpSpec("gelu_and_mul", "layer", "sparrow.layers.activation:GeluAndMul",
           "gelu_tanh(gate) * up of the fused gate/up output (Gemma)",
           "sparrow.layers.activation:gelu_and_mul_cases"),
    OpSpec("fused_moe", "layer", "sparrow.layers.fused_moe:FusedMoE",
           "mixture-of-experts MLPs: each token's top-k experts' gated MLPs, mixed by routing weight",
           "sparrow.ops.moe_cases:fused_moe_cases"),
    OpSpec("add_lora", "function", "sparrow.lora.ops:add_lora",
           "multi-LoRA: add each token's adapter update (slot per token) to a linear layer's output",
           "sparrow.lora.ops:add_lora_cases"),
    OpSpec("top_k_top_p", "function", "sparrow.sample.filters:apply_top_k_top_p",
           "sampler: mask logits outside each row's top-k and top-p", "sparrow.ops.cases:top_k_top_p_cases"),
    OpSpec("draw", "function", "sparrow.sample.sampler:draw",
           "sampler: one token per row from probabilities (seeded rows reproducible)",
           "sparrow.ops.cases:draw_cases"),
    OpSpec("sample_from_logits", "function", "sparrow.sample.sampler:sample_from_logits",
           "sampler: one token per row from logits at a temperature and a given uniform (rows nothing else filters)",
           "sparrow.ops.cases:sample_from_logits_cases"),
)}

# Attention is an op too, chosen through its own hook (sparrow_attention_backend), not this registry.
ATTENTION_OP = "attention"

_LAZY = {
    "CustomOp": "sparrow.ops.base", "OpImpl": "sparrow.ops.base",
    "bind_ops": "sparrow.ops.binding", "resolve_function_op": "sparrow.ops.binding",
    "lookup_impl": "sparrow.ops.binding", "op_table": "sparrow.ops.binding",
    "OpCase": "sparrow.ops.cases", "op_cases": "sparrow.ops.check", "run_case": "sparrow.ops.check",
}

__all__ = ["ATTENTION_OP", "KERNEL_OPS", "OpSpec", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sparrow.ops' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
