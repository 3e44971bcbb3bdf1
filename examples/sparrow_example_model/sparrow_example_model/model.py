"""IBM Granite for Sparrow, built from Sparrow's public layers.

Granite is a Llama decoder with four multipliers from its config: the embeddings are scaled by
``embedding_multiplier``, each sublayer's output by ``residual_multiplier`` before the residual
add, attention scores by ``attention_multiplier`` (instead of ``head_dim ** -0.5``), and the
logits are divided by ``logits_scaling``.

What Sparrow asks of a model class (see docs/plugins.md, "A model architecture from a plugin"):

- ``Model(hf_config, attn_backend_cls, dtype, device, tp=None)``, with attributes ``config``,
  ``vocab_size``, ``tp`` and ``attn_backend`` (the one backend instance its layers share);
- ``forward(input_ids, positions, kv_caches, attn_metadata) -> hidden_states [T, hidden]``;
- ``compute_logits(hidden_states) -> [N, vocab]`` float32;
- ``load_weights(weights)`` taking ``(checkpoint name, tensor)`` pairs;
- ``kv_cache_spec() -> (num_layers, num_kv_heads_per_rank, head_dim)``.

The layers come with tensor parallelism and per-platform kernels (the op registry binds CPU or
CUDA implementations of linear, RMSNorm, rotary and SiLU-and-mul after loading), so this model
runs with ``tensor_parallel_size`` > 1 and on every platform without code of its own for either.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from sparrow.layers.activation import SiluAndMul
from sparrow.layers.attention import Attention
from sparrow.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sparrow.layers.layernorm import RMSNorm
from sparrow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sparrow.layers.parallel import default_weight_loader, divide, resolve_tp
from sparrow.layers.rotary import get_rope

# Checkpoint projections that Sparrow's layers fuse: name -> (fused module, shard id).
FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class GraniteLayer(nn.Module):
    def __init__(self, config: Any, backend: Any, rotary_emb: nn.Module, index: int, tp: Any,
                 dtype: torch.dtype) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias,
                                          tp=tp, params_dtype=dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden, config.attention_bias,
                                        tp=tp, params_dtype=dtype)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [config.intermediate_size] * 2, config.mlp_bias,
                                                       tp=tp, params_dtype=dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, hidden, config.mlp_bias, tp=tp,
                                           params_dtype=dtype)
        self.act = SiluAndMul()
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, params_dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, params_dtype=dtype)
        self.rotary_emb = rotary_emb
        self.attn = Attention(backend, index)
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # RMSNorm(x, residual) adds x to the residual first and returns (normed, new residual):
        # scaling x before that call is Granite's ``residual + x * residual_multiplier``.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden * self.residual_multiplier, residual)
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q.view(num_tokens, -1, self.head_dim),
                               k.view(num_tokens, -1, self.head_dim))
        out = self.attn(q, k, v.view(num_tokens, -1, self.head_dim), kv_cache, metadata)
        hidden = self.o_proj(out.reshape(num_tokens, self.q_size))
        hidden, residual = self.post_attention_layernorm(hidden * self.residual_multiplier, residual)
        return self.down_proj(self.act(self.gate_up_proj(hidden))), residual


class GraniteForCausalLM(nn.Module):
    def __init__(self, hf_config: Any, attn_backend_cls: type, dtype: torch.dtype, device: torch.device,
                 tp: Any = None) -> None:
        super().__init__()
        self.config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.tp = resolve_tp(tp)
        head_dim = hf_config.hidden_size // hf_config.num_attention_heads
        self.attn_backend = attn_backend_cls(
            divide(hf_config.num_attention_heads, self.tp.world_size, "num_attention_heads"),
            max(1, hf_config.num_key_value_heads // self.tp.world_size),
            head_dim, hf_config.attention_multiplier, dtype, torch.device(device),
        )
        with torch.device(device):  # parameters are created on the device, uninitialised
            self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp=self.tp,
                                                       params_dtype=dtype)
            rotary_emb = get_rope(hf_config, head_dim)
            self.layers = nn.ModuleList(GraniteLayer(hf_config, self.attn_backend, rotary_emb, i, self.tp, dtype)
                                        for i in range(hf_config.num_hidden_layers))
            self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype=dtype)
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp=self.tp,
                                          params_dtype=dtype)
        if hf_config.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.config.embedding_multiplier
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden * self.config.residual_multiplier, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states) / self.config.logits_scaling

    def kv_cache_spec(self) -> tuple[int, int, int]:
        return len(self.layers), self.attn_backend.num_kv_heads, self.attn_backend.head_dim

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Map Hugging Face names (``model.layers.0.self_attn.q_proj.weight``...) onto this module
        tree and let each parameter's ``weight_loader`` copy this rank's slice."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.removeprefix("model.").replace("self_attn.", "").replace("mlp.", "").split(".")
            shard_id = None
            if len(parts) >= 2 and parts[-2] in FUSED:
                parts[-2], shard_id = FUSED[parts[-2]]
            param_name = ".".join(parts)
            if param_name not in params:
                raise ValueError(f"GraniteForCausalLM has no parameter for checkpoint tensor {name!r}")
            param = params[param_name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(param_name)
        return loaded  # a partial set is fine here (an RLHF weight update): the loader checks a whole one

    def check_loaded(self, loaded: set[str]) -> None:
        """Called by the model loader with what ``load_weights`` returned for the whole checkpoint."""
        params = {name for name, _ in self.named_parameters()}
        missing = sorted(params - loaded - ({"lm_head.weight"} if self.config.tie_word_embeddings else set()))
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing)}")
