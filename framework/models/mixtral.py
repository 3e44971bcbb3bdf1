"""Mixtral: Mistral's attention with a mixture-of-experts MLP in every layer.

Routing always renormalises the top-k weights (kept in float32, as transformers does). The hub
checkpoint names the block ``block_sparse_moe`` with experts' ``w1`` (gate), ``w3`` (up) and
``w2`` (down); transformers 5's in-memory names (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) load too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from sparrow.layers.fused_moe import DOWN, GATE, UP, SparseMoeBlock
from sparrow.layers.parallel import ParallelContext
from sparrow.models.llama import DecoderOptions, LlamaForCausalLM
from sparrow.models.qwen3_moe import MoeCheckpointNames


class MixtralForCausalLM(MoeCheckpointNames, LlamaForCausalLM):
    CHECKPOINT_BLOCK = "block_sparse_moe"
    EXPERT_PROJECTIONS = {"gate_up_proj": (("w1", GATE), ("w3", UP)), "down_proj": (("w2", DOWN),)}

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        for field in ("num_local_experts", "num_experts_per_tok"):
            if getattr(hf_config, field, None) is None:
                raise ValueError(f"config.json lacks the field {field!r}")
        return dataclasses.replace(super().decoder_options(hf_config), make_mlp=cls.make_mlp)

    @staticmethod
    def make_mlp(hf_config: Any, layer_index: int, tp: ParallelContext, params_dtype: torch.dtype) -> nn.Module:
        return SparseMoeBlock(
            hf_config.hidden_size, int(hf_config.num_local_experts), int(hf_config.num_experts_per_tok),
            int(hf_config.intermediate_size), renormalize=True, weights_in_model_dtype=False,
            tp=tp, params_dtype=params_dtype,
        )
