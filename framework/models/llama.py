"""Llama (and Mistral, which shares it): the decoder the Qwen models reuse with small switches.

Model interface (what the model runner relies on)::

    model = LlamaForCausalLM(hf_config, attn_backend_cls, dtype, device, tp=None)
    model.attn_backend                       # the one backend instance all layers share
    hidden = model.forward(input_ids, positions, kv_caches, attn_metadata)   # [T, hidden]
    logits = model.compute_logits(hidden)    # [N, vocab] float32
    model.load_weights(weights)              # (hf_name, tensor) pairs
    model.kv_cache_spec()                    # (num_layers, num_kv_heads_per_rank, head_dim)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

import torch
from torch import nn

from sparrow.attention import AttentionBackend, AttentionMetadata
from sparrow.layers.activation import SiluAndMul
from sparrow.layers.attention import Attention
from sparrow.layers.embedding import ParallelLMHead, PromptEmbeds, VocabParallelEmbedding, with_prompt_embeds
from sparrow.layers.layernorm import RMSNorm
from sparrow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sparrow.layers.parallel import ParallelContext, default_weight_loader, divide, resolve_tp
from sparrow.layers.rotary import RotaryEmbedding, get_rope
from sparrow.models.windows import attended_windows

# fused parameter -> (checkpoint projection, shard id) in the fused order
STACKED_PARAMS: dict[str, tuple[tuple[str, Hashable], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}
# Checkpoint tensors that hold no weights (rotary caches some exporters saved).
# KV cache scales (fp8 exporters write them) are not parameters: the CUDA runner reads them itself
# for kv_cache_dtype="fp8" (sparrow_cuda.model_runner.checkpoint_kv_scales); otherwise unused.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                    "self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs; the message names them."""


@dataclass(frozen=True, slots=True)
class DecoderOptions:
    """The switches that tell Llama, Qwen2 and Qwen3 decoders apart."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    # make_mlp(hf_config, layer_index, tp, params_dtype) -> the layer's MLP module (a mixture of
    # experts, for instance); None: the dense LlamaMLP.
    make_mlp: Callable[[Any, int, ParallelContext, torch.dtype], nn.Module] | None = None


def model_head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_per_rank(total_num_kv_heads: int, tp: ParallelContext) -> int:
    # KV heads are replicated (one per rank) when the group has more ranks than KV heads.
    return max(1, total_num_kv_heads // tp.world_size)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 tp: ParallelContext, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, tp=tp, params_dtype=params_dtype
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp=tp, params_dtype=params_dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, 2 * intermediate / tp] -> [T, intermediate / tp] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, options: DecoderOptions, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, layer_index: int, tp: ParallelContext,
                 params_dtype: torch.dtype) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        head_dim = model_head_dim(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, hf_config.num_attention_heads, hf_config.num_key_value_heads,
            options.qkv_bias, tp=tp, params_dtype=params_dtype,
        )
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * head_dim, hidden_size, options.o_proj_bias,
            tp=tp, params_dtype=params_dtype,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        if options.qk_norm:
            self.q_norm = RMSNorm(head_dim, hf_config.rms_norm_eps, params_dtype=params_dtype)
            self.k_norm = RMSNorm(head_dim, hf_config.rms_norm_eps, params_dtype=params_dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # one instance shared by every layer (no parameters)
        # Mistral, Phi-3 and Qwen2 with use_sliding_window attend through a window.
        self.attn = Attention(backend, layer_index, sliding_window=attended_windows(hf_config)[layer_index])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [T, (Hq + 2 * Hkv) * head_dim]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, options: DecoderOptions, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, layer_index: int, tp: ParallelContext,
                 params_dtype: torch.dtype) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.self_attn = LlamaAttention(hf_config, options, backend, rotary_emb, layer_index, tp, params_dtype)
        if options.make_mlp is not None:
            self.mlp = options.make_mlp(hf_config, layer_index, tp, params_dtype)
        else:
            self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, options.mlp_bias, tp,
                                params_dtype)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype=params_dtype)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype=params_dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous sublayer is fused into each norm call.
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config: Any, options: DecoderOptions, backend: AttentionBackend,
                 tp: ParallelContext, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, tp=tp, params_dtype=params_dtype
        )
        rotary_emb = get_rope(hf_config, model_head_dim(hf_config))
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, options, backend, rotary_emb, index, tp, params_dtype)
            for index in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype=params_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, prompt_embeds: PromptEmbeds | None = None) -> torch.Tensor:
        hidden_states = with_prompt_embeds(self.embed_tokens(input_ids), prompt_embeds)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama-architecture causal LM; subclasses switch options in :meth:`decoder_options`."""

    # forward() takes prompt_embeds (enable_prompt_embeds): rows that replace token embeddings.
    supports_prompt_embeds = True

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias, o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )

    def __init__(self, hf_config: Any, attn_backend_cls: type[AttentionBackend], dtype: torch.dtype,
                 device: torch.device | str, tp: ParallelContext | None = None) -> None:
        super().__init__()
        check_config(hf_config)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.tp = resolve_tp(tp)
        self.dtype = dtype
        device = torch.device(device)
        head_dim = model_head_dim(hf_config)
        self.attn_backend = attn_backend_cls(
            divide(hf_config.num_attention_heads, self.tp.world_size, "num_attention_heads"),
            num_kv_heads_per_rank(hf_config.num_key_value_heads, self.tp),
            head_dim, head_dim ** -0.5, dtype, device,
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Parameters are allocated uninitialised, directly on the device: building costs no init.
        with torch.device(device):
            self.model = LlamaModel(hf_config, self.decoder_options(hf_config), self.attn_backend,
                                    self.tp, dtype)
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp=self.tp,
                                          params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, prompt_embeds: PromptEmbeds | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_caches: one per layer -> hidden_states [T, hidden].
        ``prompt_embeds`` (rows [K] int64, values [K, hidden]): embeddings that replace those of
        ``input_ids`` at those flat positions (prompts given as embeddings)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"kv_caches must hold one tensor per layer ({len(self.model.layers)}), got {len(kv_caches)}"
            )
        if prompt_embeds is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, prompt_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [N, hidden] -> [N, vocab] float32
        return self.lm_head.compute_logits(hidden_states)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads_per_rank, head_dim) of the paged KV cache."""
        return len(self.model.layers), self.attn_backend.num_kv_heads, self.attn_backend.head_dim

    # ------------------------------------------------------------------------------------------
    # Weight loading
    # ------------------------------------------------------------------------------------------

    def checkpoint_names(self) -> dict[str, tuple[str, Hashable]]:
        """checkpoint tensor name -> (parameter name, shard id) for every tensor the model needs."""
        names: dict[str, tuple[str, Hashable]] = {}
        for param_name, _ in self.named_parameters():
            module_path, _, leaf = param_name.rpartition(".")
            parent, _, fused = module_path.rpartition(".")
            if fused in STACKED_PARAMS:
                for projection, shard_id in STACKED_PARAMS[fused]:
                    names[f"{parent}.{projection}.{leaf}"] = (param_name, shard_id)
            else:
                names[param_name] = (param_name, None)
        return names

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the checkpoint names loaded.

        q/k/v and gate/up projections are fused on the fly; rotary caches and, with tied
        embeddings, ``lm_head.weight`` are skipped. Raises ValueError naming unknown or misshapen
        tensors. A partial set is loaded as given (vLLM's contract: an RLHF weight update sends
        one tensor at a time); the model loader checks a checkpoint was whole with
        :meth:`check_loaded`.
        """
        params = dict(self.named_parameters())
        expected = self.checkpoint_names()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES) or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name in expected:
                param_name, shard_id = expected[name]
                loaded.add(name)
            elif name in params:  # an already fused tensor (e.g. qkv_proj.weight)
                param_name, shard_id = name, None
                loaded.update(n for n, (p, _) in expected.items() if p == name)
            else:
                unexpected.append(name)
                continue
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as exc:
                raise ValueError(f"weight {name!r}: {exc}") from exc
        if unexpected:
            raise ValueError(
                f"{type(self).__name__} has no parameter for checkpoint tensors: {_listing(unexpected)}"
            )
        return loaded

    def check_loaded(self, loaded: set[str]) -> None:
        """Raise :class:`MissingWeightsError` naming the checkpoint tensors ``loaded`` (what
        :meth:`load_weights` returned) lacks."""
        missing = sorted(set(self.checkpoint_names()) - loaded)
        if missing:
            raise MissingWeightsError(f"checkpoint is missing tensors: {_listing(missing)}")


def _listing(names: list[str], limit: int = 20) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


def check_config(hf_config: Any) -> None:
    """Raise an error naming the config field this model code does not support."""
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"hidden_act {activation!r} is not supported (only 'silu')")
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                  "intermediate_size", "vocab_size", "rms_norm_eps"):
        if getattr(hf_config, field, None) is None:
            raise ValueError(f"config.json lacks the field {field!r}")

