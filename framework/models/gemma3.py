"""Gemma 3 (text): the Gemma 2 decoder with zero-centred RMSNorms on q and k before RoPE, no
attention soft-capping, and RoPE of its own for the sliding layers.

transformers 5 keys ``rope_parameters`` by layer kind: ``sliding_attention`` (base
``rope_local_base_freq``, 10k in the published models) and ``full_attention`` (base ``rope_theta``,
1M, possibly with ``linear`` scaling). Sliding layers use the first, global layers the second.
"""

from __future__ import annotations

from typing import Any

from sparrow.models.gemma2 import Gemma2ForCausalLM, GemmaOptions


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def gemma_options(cls, hf_config: Any) -> GemmaOptions:
        # transformers' Gemma 3 attention ignores attn_logit_softcapping; so does this one.
        return GemmaOptions(qk_norm=True, rope_per_layer_type=True)
