"""Random-weight test models of architectures whose checkpoint layout transformers knows best.

The dense Llama-family recipe (:mod:`sparrow.tiny.model`) lists its checkpoint tensors by hand.
Mixture-of-experts, Gemma and Phi models have more shapes (expert stacks, extra norms, fused
projections), so their tensors are taken from the transformers model itself: it is built from the
config on the CPU, every tensor of its state dict is overwritten from a generator seeded with
``seed`` (in name order, so the bytes are the same on every build), and ``save_pretrained`` writes
the checkpoint in the layout published checkpoints use (one tensor per expert, for instance).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

# arch -> (transformers config class, architecture name in config.json, per-arch config defaults)
HF_ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=32,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=32,
                    rope_local_base_freq=10000.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(eos_token_id=None, pad_token_id=None)),
    # Not built into Sparrow: the model of the example plugin (examples/sparrow_example_model).
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                     logits_scaling=2.0)),
}

# Same scales as the dense recipe (see sparrow.tiny.model for why).
LINEAR_GAIN = 1.0
BIAS_STD = 0.1
NORM_WEIGHT_STD = 0.1
LOGIT_STD = 4.0


def tensor_kind(name: str, shape: tuple[int, ...], tied: bool) -> str:
    """``embedding``, ``lm_head``, ``norm``, ``bias`` or ``linear`` (expert stacks included)."""
    if name.endswith("embed_tokens.weight"):
        return "lm_head" if tied else "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]  # e.g. input_layernorm, q_norm, norm
    if "norm" in module:
        return "norm"
    if name.endswith(".bias") or len(shape) == 1:
        return "bias"
    return "linear"


def fill_random(model: torch.nn.Module, seed: int, zero_centered_norms: bool) -> None:
    """Overwrite every tensor of ``model``'s state dict from a generator seeded with ``seed``.

    Linear weights (and each expert's matrix in a stacked ``[E, out, in]`` tensor) get std
    ``1/sqrt(in)``; norms are ``1 + noise`` (``noise`` alone where the model computes
    ``x * (1 + w)``, as Gemma does), so a norm that is not loaded shows up in a comparison.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict()
    with torch.no_grad():
        for name in sorted(state):
            tensor = state[name]
            if not tensor.is_floating_point():
                continue
            shape = tuple(tensor.shape)
            noise = torch.randn(shape, generator=generator, dtype=torch.float32)
            kind = tensor_kind(name, shape, tied)
            if kind == "norm":
                value = NORM_WEIGHT_STD * noise + (0.0 if zero_centered_norms else 1.0)
            elif kind == "linear":
                value = (LINEAR_GAIN / math.sqrt(shape[-1])) * noise
            elif kind == "bias":
                value = BIAS_STD * noise
            elif kind == "lm_head":
                value = (LOGIT_STD / math.sqrt(config.hidden_size)) * noise
            else:
                value = noise
            tensor.copy_(value.to(tensor.dtype))


def build_hf_config(arch: str, fields: dict[str, Any]) -> Any:
    """The transformers config of ``arch`` from preset ``fields`` (already merged with overrides)."""
    import transformers

    config_cls_name, architecture, defaults = HF_ARCHITECTURES[arch]
    merged = dict(defaults)
    merged.update(fields)
    merged["architectures"] = [architecture]
    if arch in ("phi3", "granite"):
        merged.pop("head_dim", None)  # derived from hidden_size
    if arch in ("gemma2", "gemma3"):
        merged.pop("hidden_act", None)  # Gemma names its activation hidden_activation
    return getattr(transformers, config_cls_name)(**merged)


def save_random_model(out: Path, config: Any, arch: str, seed: int, torch_dtype: torch.dtype) -> None:
    """Build the transformers model of ``config``, fill it with seeded weights, write it to ``out``."""
    import transformers

    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fill_random(model, seed, zero_centered_norms=arch in ("gemma2", "gemma3"))
    model = model.to(torch_dtype)
    model.save_pretrained(str(out), safe_serialization=True)
