"""A locally built EAGLE head for a target model (sparrow.spec_decode.eagle), for tests and docs.

``build_eagle_dir(target_dir, out_dir)`` writes a head directory in vLLM's EAGLE-1 layout:
config.json (``EagleLlamaForCausalLM``, the target's sizes and rotary settings) and
model.safetensors with ``fc.weight`` [hidden, 2 * hidden] and one decoder layer
``layers.0.*``. No head here is trained:

* ``copy_target_layer=True`` (default): the layer is the target's first layer (with its input
  norm, q/k norms where the target has them) plus the target's final ``norm.weight``, and ``fc``
  passes the token embedding through and mixes in the hidden state at a small, seeded scale.
  The head then behaves like a one-layer cut of the target over its window, so its drafts are
  accepted now and then: enough to test the plumbing.
* ``copy_target_layer=False``: every weight random from ``seed`` (EAGLE-1's layout without input
  or final norm); drafts are then almost never accepted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from sparrow.spec_decode.config import EAGLE_ARCHITECTURES

# Scale of the hidden-state half of fc in a copied head (the embedding half is the identity).
HIDDEN_MIX = 0.1
# Target config fields a head keeps (rotary settings included, so positions mean the same).
KEPT_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
               "max_position_embeddings", "hidden_act", "attention_bias")


def build_eagle_dir(target_dir: str | Path, out_dir: str | Path, seed: int = 0, copy_target_layer: bool = True,
                    save_dtype: str = "float32") -> Path:
    """Write an EAGLE head for ``target_dir`` into ``out_dir``; returns its path."""
    from safetensors.torch import load_file, save_file

    from sparrow.model_loader import safetensors_files

    target = Path(target_dir)
    target_config = json.loads((target / "config.json").read_text())
    config = {key: target_config[key] for key in KEPT_FIELDS if target_config.get(key) is not None}
    hidden = config["hidden_size"]
    config.update(architectures=[EAGLE_ARCHITECTURES[0]], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, torch_dtype=save_dtype)
    config.setdefault("head_dim", hidden // config["num_attention_heads"])
    dtype = getattr(torch, save_dtype)
    generator = torch.Generator().manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    weights: dict[str, torch.Tensor] = {}
    if copy_target_layer:
        mix = HIDDEN_MIX / math.sqrt(hidden) * noise(hidden, hidden)
        weights["fc.weight"] = torch.cat([torch.eye(hidden), mix], dim=1)
        for path in safetensors_files(target):
            for name, tensor in load_file(str(path)).items():
                if name.startswith("model.layers.0."):
                    weights[name.removeprefix("model.")] = tensor.float()
                elif name == "model.norm.weight":
                    weights["norm.weight"] = tensor.float()
    else:
        weights.update(_random_layer(config, noise))
        weights["fc.weight"] = noise(hidden, 2 * hidden) / math.sqrt(2 * hidden)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({name: tensor.to(dtype).contiguous() for name, tensor in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _random_layer(config: dict, noise) -> dict[str, torch.Tensor]:
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (q_size, hidden), "self_attn.k_proj": (kv_size, hidden),
              "self_attn.v_proj": (kv_size, hidden), "self_attn.o_proj": (hidden, q_size),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    layer = {f"layers.0.{name}.weight": noise(*shape) / math.sqrt(shape[1]) for name, shape in shapes.items()}
    layer["layers.0.post_attention_layernorm.weight"] = 1.0 + 0.1 * noise(hidden)
    return layer
