"""What the built-in quantization methods share: their op implementations listed per platform by
import path (so checking a configuration imports no kernel), and the configuration checks every
one of them runs before any engine process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sparrow.quantization import QuantizationMethod

if TYPE_CHECKING:
    from sparrow.config import EngineConfig
    from sparrow.ops.base import OpImpl

# config.json fields that make a model mixture-of-experts (Qwen3-MoE, Mixtral, DeepSeek).
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def config_error(field: str, message: str) -> Exception:
    from sparrow.config import ConfigError

    return ConfigError(f"invalid engine argument {field!r}: {message}")


class BuiltinQuantization(QuantizationMethod):
    """A method whose ``linear`` (and maybe ``lm_head``, ``fused_moe``) implementations are listed per platform.

    ``implementations``: ``{platform: {op: "module:OpImpl"}}``; a platform absent from it is
    refused at configuration time. ``needs_checkpoint``: True when the checkpoint must already be
    quantized in this method's format, False when the method quantizes an unquantized one on load.
    """

    implementations: ClassVar[dict[str, dict[str, str]]] = {}
    needs_checkpoint: ClassVar[bool] = False
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")

    def check_config(self, config: EngineConfig) -> None:
        device = config.device.device
        if device not in self.implementations:
            raise config_error("quantization", f"{self.name!r} has no implementation on device {device!r} "
                               f"(it runs on: {', '.join(sorted(self.implementations))})")
        if config.model.dtype != "auto" and config.model.dtype not in self.dtypes:
            raise config_error("dtype", f"quantization {self.name!r} computes in {', '.join(self.dtypes)}, "
                               f"got {config.model.dtype!r}")
        experts = [f for f in EXPERT_FIELDS if getattr(self.hf_config, f, None)]
        # A method quantizes a mixture-of-experts model where it serves the experts' op too (its
        # router stays in full precision): int8 on the CPU, fp8 on CUDA, awq and gptq on both.
        if experts and "fused_moe" not in self.implementations.get(device, {}):
            raise config_error("quantization", f"{self.name!r} does not quantize mixture-of-experts models "
                               f"(config.json has {experts[0]}) on device {device!r}; of the built-in methods "
                               "'int8' does on the CPU, 'fp8' on CUDA, and 'awq' and 'gptq' checkpoints load on "
                               "CPU and CUDA: "
                               "run it unquantized or with one of those")
        if self.needs_checkpoint and not self.hf_quant_config:
            raise config_error("quantization", f"{self.name!r} loads checkpoints quantized with it (config.json "
                               "quantization_config); this model has none")
        if not self.needs_checkpoint and self.hf_quant_config:
            raise config_error("quantization", f"{self.name!r} quantizes an unquantized checkpoint on load; this one "
                               f"is already quantized ({self.hf_quant_config.get('quant_method')!r})")
        self.check_checkpoint(config)

    def check_checkpoint(self, config: EngineConfig) -> None:
        """Refuse what the checkpoint's ``quantization_config`` or the model's shapes make
        impossible (ConfigError naming the field)."""

    def op_overrides(self, platform: str) -> dict[str, type[OpImpl]]:
        from sparrow.plugins import import_object

        return {op: import_object(path) for op, path in self.implementations.get(platform, {}).items()}


def tp_shapes(hf_config: Any, tp: int) -> dict[str, int]:
    """Per-rank sizes the linear layers split (sparrow.layers.linear): the column-parallel
    outputs and the row-parallel inputs of attention and MLP."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    shapes = {
        "attention heads x head_dim": heads * head_dim // tp,
        "key/value heads x head_dim": max(1, kv_heads // tp) * head_dim,
        "intermediate_size": hf_config.intermediate_size // tp,
    }
    if getattr(hf_config, "moe_intermediate_size", None):  # Qwen3-MoE's experts (Mixtral's: intermediate_size)
        shapes["moe_intermediate_size"] = hf_config.moe_intermediate_size // tp
    return shapes
