"""Qwen3-MoE: Qwen3's attention (q/k norms) with a mixture-of-experts MLP in most layers.

Layer ``i`` is sparse unless it is listed in ``mlp_only_layers`` or ``(i + 1) %
decoder_sparse_step != 0`` (transformers' rule); dense layers keep a gated MLP of
``intermediate_size``. Experts have ``moe_intermediate_size``; routing renormalises the top-k
weights when ``norm_topk_prob``.

Checkpoints: the hub layout (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, router
``mlp.gate.weight``) or transformers 5's fused stacks (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) load into the stacked expert parameters of
:class:`~sparrow.layers.fused_moe.FusedMoE`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Hashable

import torch
from torch import nn

from sparrow.layers.fused_moe import DOWN, GATE, UP, FusedMoE, SparseMoeBlock
from sparrow.layers.parallel import ParallelContext
from sparrow.models.llama import DecoderOptions, LlamaMLP
from sparrow.models.qwen3 import Qwen3ForCausalLM


class MoeCheckpointNames:
    """Maps per-expert checkpoint tensors onto the stacked expert parameters (a mixin over
    :class:`~sparrow.models.llama.LlamaForCausalLM`)."""

    # the MoE block's module name in the checkpoint (Mixtral: block_sparse_moe)
    CHECKPOINT_BLOCK: ClassVar[str] = "mlp"
    # stacked parameter -> ((checkpoint projection of one expert, shard projection), ...)
    EXPERT_PROJECTIONS: ClassVar[dict[str, tuple[tuple[str, str], ...]]] = {
        "gate_up_proj": (("gate_proj", GATE), ("up_proj", UP)),
        "down_proj": (("down_proj", DOWN),),
    }

    def checkpoint_names(self) -> dict[str, tuple[str, Hashable]]:
        names = super().checkpoint_names()  # type: ignore[misc]
        for module_name, module in self.named_modules():  # type: ignore[attr-defined]
            if not isinstance(module, FusedMoE):
                continue
            block = module_name.rpartition(".")[0]  # model.layers.N.mlp
            checkpoint_block = f"{block.rpartition('.')[0]}.{self.CHECKPOINT_BLOCK}"
            if module.quantized:
                self._rename_quantized_experts(names, module_name, checkpoint_block)
            else:
                self._name_stacked_experts(names, module, module_name, checkpoint_block)
            if checkpoint_block != block:
                router = f"{block}.gate.weight"
                names[f"{checkpoint_block}.gate.weight"] = names.pop(router)
        return names

    def _rename_quantized_experts(self, names: dict[str, tuple[str, Hashable]], module_name: str,
                                  checkpoint_block: str) -> None:
        """Quantized experts are linear layers ``{module}.{e}.gate_up_proj`` / ``.down_proj``: the
        base class named their tensors as a dense MLP's (``{module}.{e}.gate_proj.qweight``...);
        put them under the checkpoint's block and projection names (Mixtral: ``w1``/``w3``/``w2``)."""
        checkpoint_projection = {part: projection for projections in self.EXPERT_PROJECTIONS.values()
                                 for projection, part in projections}
        dense_part = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
        prefix = module_name + "."
        for key in [key for key in names if key.startswith(prefix)]:
            expert, projection, leaf = key[len(prefix):].split(".", 2)
            names[f"{checkpoint_block}.experts.{expert}.{checkpoint_projection[dense_part[projection]]}.{leaf}"] = \
                names.pop(key)

    def _name_stacked_experts(self, names: dict[str, tuple[str, Hashable]], module: FusedMoE, module_name: str,
                              checkpoint_block: str) -> None:
        for param_leaf, projections in self.EXPERT_PROJECTIONS.items():
            param_name = f"{module_name}.{param_leaf}"
            del names[param_name]  # loaded per expert (or whole, under its own name)
            for expert in range(module.num_experts):
                for projection, part in projections:
                    names[f"{checkpoint_block}.experts.{expert}.{projection}.weight"] = (param_name, (part, expert))


def is_sparse_layer(hf_config: Any, layer_index: int) -> bool:
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return (layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and int(hf_config.num_experts) > 0 and (layer_index + 1) % step == 0)


class Qwen3MoeForCausalLM(MoeCheckpointNames, Qwen3ForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(hf_config, field, None) is None:
                raise ValueError(f"config.json lacks the field {field!r}")
        return dataclasses.replace(super().decoder_options(hf_config), make_mlp=cls.make_mlp)

    @staticmethod
    def make_mlp(hf_config: Any, layer_index: int, tp: ParallelContext, params_dtype: torch.dtype) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_index):
            return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, False, tp, params_dtype)
        return SparseMoeBlock(
            hf_config.hidden_size, int(hf_config.num_experts), int(hf_config.num_experts_per_tok),
            int(hf_config.moe_intermediate_size), renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
            weights_in_model_dtype=True, tp=tp, params_dtype=params_dtype,
        )
