"""Pre-flight checks of how the model splits over ranks (part of ``sparrow.engine.preflight``):
tensor parallelism's heads and intermediate sizes, and expert parallelism's experts."""

from __future__ import annotations

from typing import Any

from sparrow.config import EngineConfig
from sparrow.engine.preflight_files import _error


def check_parallel(config: EngineConfig, hf_config: Any) -> None:
    parallel = config.parallel
    if parallel.data_parallel_rank >= parallel.data_parallel_size:
        raise _error("data_parallel_rank", f"{parallel.data_parallel_rank} must be smaller than "
                     f"data_parallel_size={parallel.data_parallel_size}")
    problem = tp_split_problem(parallel.tensor_parallel_size, hf_config, "model")
    if problem is not None:
        raise _error("tensor_parallel_size", problem)
    if parallel.enable_expert_parallel:
        problem = expert_parallel_problem(config, hf_config)
        if problem is not None:
            raise _error("enable_expert_parallel", problem)


def tp_split_problem(tp: int, hf_config: Any, what: str) -> str | None:
    """Why ``tp`` ranks cannot split a model of ``hf_config`` (a transformers config or a
    namespace of config.json), or None. Shapes the layers split across ranks
    (sparrow.layers.linear); an attribute a model does not have is not checked."""
    if tp == 1:
        return None
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = getattr(hf_config, "intermediate_size", None)
    if heads is not None and heads % tp:
        return f"{tp} does not divide the {what}'s {heads} attention heads"
    if kv_heads is not None and (tp % kv_heads if tp >= kv_heads else kv_heads % tp):
        return f"{tp} and the {what}'s {kv_heads} KV heads must divide one another"
    if intermediate is not None and intermediate % tp:
        return f"{tp} does not divide the {what}'s intermediate_size {intermediate}"
    return None


def expert_parallel_problem(config: EngineConfig, hf_config: Any) -> str | None:
    """Why ``enable_expert_parallel`` cannot split this model's experts, or None."""
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    architecture = (list(getattr(hf_config, "architectures", None) or []) or ["(none)"])[0]
    if not num_experts:
        return f"applies to mixture-of-experts models; {architecture} has no experts"
    tp = config.parallel.tensor_parallel_size
    if num_experts < tp:
        return f"needs at least as many experts as ranks: {num_experts} experts, tensor_parallel_size={tp}"
    quantization = config.model.quantization or getattr(hf_config, "quantization_config", None)
    if quantization:
        return "is not supported with a quantized model (quantization, or a quantization_config in config.json)"
    if config.parallel.data_parallel_size > 1:
        return ("splits the experts over one engine's tensor-parallel ranks; data-parallel engines do not share "
                "experts here (raise tensor_parallel_size instead of data_parallel_size)")
    return None
