"""Gemma 2 (and the decoder Gemma 3 builds on): Llama's attention and weights with Gemma's habits.

What differs from Llama, each as transformers computes it:

* RMSNorm is zero-centred: ``normed(x) * (1 + w)``, all in float32, cast back at the end;
* four norms per layer: after attention (before its residual add) and around the MLP;
* the embedding output is multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype;
* the attention scale is ``query_pre_attn_scalar ** -0.5``; layers alternate between sliding
  window and global attention (``layer_types``), and Gemma 2 soft-caps the attention scores
  (``attn_logit_softcapping``) and the final logits (``final_logit_softcapping``);
* the MLP is ``gelu_tanh(gate) * up`` (``hidden_activation = gelu_pytorch_tanh``).

Checkpoint names are Llama's plus ``pre_feedforward_layernorm``/``post_feedforward_layernorm``,
so weight loading (q/k/v and gate/up fused on the fly) is Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparrow.attention import AttentionBackend, AttentionMetadata
from sparrow.layers.activation import GeluAndMul
from sparrow.layers.attention import Attention
from sparrow.layers.embedding import ParallelLMHead, PromptEmbeds, VocabParallelEmbedding, with_prompt_embeds
from sparrow.layers.parallel import ParallelContext, divide, resolve_tp
from sparrow.layers.rotary import RotaryEmbedding, get_rope
from sparrow.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    model_head_dim,
    num_kv_heads_per_rank,
)
from sparrow.models.windows import FULL, SLIDING, attended_windows, layer_sliding_windows

SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)


@dataclass(frozen=True, slots=True)
class GemmaOptions:
    """The switches that tell Gemma 2 and Gemma 3 decoders apart."""

    qk_norm: bool = False  # zero-centred RMSNorm over head_dim on q and k before RoPE (Gemma 3)
    attn_logit_softcapping: float | None = None  # Gemma 2
    rope_per_layer_type: bool = False  # sliding and full layers have their own RoPE (Gemma 3)


class GemmaRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` in float32; the weight is stored zero-centred."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        # Uninitialised on purpose: load_weights overwrites it.
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden_size]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaAttention(LlamaAttention):
    """Llama's q/k/v/o projections with Gemma's window, soft cap and (Gemma 3) q/k norms."""

    def __init__(self, hf_config: Any, options: GemmaOptions, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, layer_index: int, sliding_window: int | None,
                 tp: ParallelContext, params_dtype: torch.dtype) -> None:
        bias = bool(getattr(hf_config, "attention_bias", False))
        super().__init__(hf_config, DecoderOptions(qkv_bias=bias, o_proj_bias=bias), backend, rotary_emb,
                         layer_index, tp, params_dtype)
        if options.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, hf_config.rms_norm_eps, params_dtype=params_dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, hf_config.rms_norm_eps, params_dtype=params_dtype)
        self.attn = Attention(backend, layer_index, sliding_window=sliding_window,
                              logits_soft_cap=options.attn_logit_softcapping)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, options: GemmaOptions, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, layer_index: int, sliding_window: int | None,
                 tp: ParallelContext, params_dtype: torch.dtype) -> None:
        super().__init__()
        hidden_size, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = GemmaAttention(hf_config, options, backend, rotary_emb, layer_index, sliding_window,
                                        tp, params_dtype)
        self.mlp = LlamaMLP(hidden_size, hf_config.intermediate_size, False, tp, params_dtype)
        self.mlp.act_fn = GeluAndMul()
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        for name in norms:
            setattr(self, name, GemmaRMSNorm(hidden_size, eps, params_dtype=params_dtype))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        attended = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp_out)


class GemmaModel(nn.Module):
    def __init__(self, hf_config: Any, options: GemmaOptions, backend: AttentionBackend,
                 tp: ParallelContext, params_dtype: torch.dtype) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hidden_size, tp=tp,
                                                   params_dtype=params_dtype)
        # transformers rounds sqrt(hidden_size) to the model's dtype before multiplying (in bf16,
        # sqrt(3072) = 55.43 becomes 55.5), and so do we.
        normalizer = torch.tensor(hidden_size ** 0.5, dtype=torch.float32).to(params_dtype)
        self.register_buffer("normalizer", normalizer, persistent=False)
        windows = layer_sliding_windows(hf_config)
        head_dim = model_head_dim(hf_config)
        if options.rope_per_layer_type:
            ropes = {kind: get_rope(hf_config, head_dim, layer_type=kind) for kind in (SLIDING, FULL)}
        else:
            ropes = dict.fromkeys((SLIDING, FULL), get_rope(hf_config, head_dim))
        self.rotary_embs = nn.ModuleDict({kind: rope for kind, rope in ropes.items()})
        # A sliding layer keeps its RoPE when disable_sliding_window lets it attend to everything.
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, options, backend, ropes[SLIDING if window else FULL], index, attended, tp,
                              params_dtype)
            for index, (window, attended) in enumerate(zip(windows, attended_windows(hf_config)))
        )
        self.norm = GemmaRMSNorm(hidden_size, hf_config.rms_norm_eps, params_dtype=params_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, prompt_embeds: PromptEmbeds | None = None) -> torch.Tensor:
        # transformers' embedding scales by the normalizer itself, so given embeddings are not scaled
        hidden_states = with_prompt_embeds(self.embed_tokens(input_ids) * self.normalizer, prompt_embeds)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer(positions, hidden_states, kv_cache, attn_metadata)
        return self.norm(hidden_states)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; the forward, cache spec and weight loading are Llama's (same interface)."""

    @classmethod
    def gemma_options(cls, hf_config: Any) -> GemmaOptions:
        cap = getattr(hf_config, "attn_logit_softcapping", None)
        return GemmaOptions(attn_logit_softcapping=float(cap) if cap else None)

    def __init__(self, hf_config: Any, attn_backend_cls: type[AttentionBackend], dtype: torch.dtype,
                 device: torch.device | str, tp: ParallelContext | None = None) -> None:
        nn.Module.__init__(self)
        check_gemma_config(hf_config)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.tp = resolve_tp(tp)
        self.dtype = dtype
        device = torch.device(device)
        self.attn_backend = attn_backend_cls(
            divide(hf_config.num_attention_heads, self.tp.world_size, "num_attention_heads"),
            num_kv_heads_per_rank(hf_config.num_key_value_heads, self.tp),
            model_head_dim(hf_config), float(hf_config.query_pre_attn_scalar) ** -0.5, dtype, device,
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        cap = getattr(hf_config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None
        with torch.device(device):
            self.model = GemmaModel(hf_config, self.gemma_options(hf_config), self.attn_backend, self.tp, dtype)
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp=self.tp,
                                          params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)  # [N, vocab] float32
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def check_gemma_config(hf_config: Any) -> None:
    """Raise a ValueError naming the config field this model code does not support."""
    activation = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_activation {activation!r} is not supported (only 'gelu_pytorch_tanh')")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=true is not supported (causal language models only)")
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                  "intermediate_size", "vocab_size", "rms_norm_eps", "query_pre_attn_scalar"):
        if getattr(hf_config, field, None) is None:
            raise ValueError(f"config.json lacks the field {field!r}")
