"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE, and no q/k/v bias.

``head_dim`` comes from the config (it need not be hidden_size / num_attention_heads).
"""

from __future__ import annotations

from typing import Any

from sparrow.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm=True)
