"""Qwen2: the Llama decoder with a bias on the q/k/v projections (none on o_proj or the MLP)."""

from __future__ import annotations

from typing import Any

from sparrow.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
