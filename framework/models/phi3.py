"""Phi-3: the Llama decoder with fused checkpoint tensors and LongRoPE.

Phi-3 checkpoints store ``self_attn.qkv_proj`` (q, k, v rows stacked) and ``mlp.gate_up_proj``
(gate rows, then up rows). They are split here into the per-projection tensors Llama's loader
takes, so that each tensor-parallel rank keeps its own shard of each part. RoPE may be
``longrope`` (``su`` in older configs; see :mod:`sparrow.layers.rotary`), and ``sliding_window``
applies to every layer (:mod:`sparrow.models.windows`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from sparrow.models.llama import LlamaForCausalLM, model_head_dim


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        config = self.config
        head_dim = model_head_dim(config)
        q_size = config.num_attention_heads * head_dim
        kv_size = config.num_key_value_heads * head_dim
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith("self_attn.qkv_proj"):
                base = prefix[: -len("qkv_proj")]
                _check_rows(name, tensor, q_size + 2 * kv_size)
                for part, start, end in (("q_proj", 0, q_size), ("k_proj", q_size, q_size + kv_size),
                                         ("v_proj", q_size + kv_size, q_size + 2 * kv_size)):
                    yield f"{base}{part}.{leaf}", tensor[start:end]
            elif prefix.endswith("mlp.gate_up_proj"):
                base = prefix[: -len("gate_up_proj")]
                _check_rows(name, tensor, 2 * config.intermediate_size)
                size = config.intermediate_size
                yield f"{base}gate_proj.{leaf}", tensor[:size]
                yield f"{base}up_proj.{leaf}", tensor[size:]
            else:
                yield name, tensor


def _check_rows(name: str, tensor: Any, rows: int) -> None:
    # A torch.Tensor, or (tensor parallel) a lazy safetensors slice: row ranges of either read as
    # a tensor, which each rank's weight_loader narrows to its shard.
    shape = tuple(tensor.shape) if hasattr(tensor, "shape") else tuple(tensor.get_shape())
    if shape[0] != rows:
        raise ValueError(f"weight {name!r}: expected {rows} rows, got shape {shape}")
