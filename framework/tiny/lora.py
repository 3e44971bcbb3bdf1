"""Tiny LoRA adapters built locally (fixed seed, nothing downloaded), and merged model copies.

``build_lora_adapter(model_dir, out_dir, rank=8, alpha=16, targets=..., seed=0)`` writes a PEFT
adapter directory (``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's tensor
names) for a llama-family model directory. Unlike a freshly initialised PEFT adapter (whose B is
zero) both A and B are random, so the adapter visibly changes what the model generates.

``merge_lora_adapter(model_dir, adapter_dir, out_dir)`` writes a copy of the base model with every
targeted weight replaced by ``W + scaling * B @ A``: the reference Hugging Face transformers runs
to check the engine's adapter path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch

from sparrow.lora.peft import CONFIG_FILE, SUPPORTED_TARGETS, WEIGHTS_FILE, projection_shapes, read_adapter_config

ALL_TARGETS = SUPPORTED_TARGETS
# Spread of B: each adapter shifts the projections' outputs by a fraction of their own size.
B_GAIN = 0.25


def _parent(projection: str) -> str:
    return "self_attn" if projection.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"


def peft_tensor_name(layer: int, projection: str, half: str) -> str:
    """PEFT's name of an adapter tensor (``half``: "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{_parent(projection)}.{projection}.lora_{half}.weight"


def build_lora_adapter(model_dir: str | Path, out_dir: str | Path, rank: int = 8, alpha: float = 16,
                       targets: Sequence[str] = ALL_TARGETS, seed: int = 0, use_rslora: bool = False,
                       trust_remote_code: bool = False) -> Path:
    """Write a PEFT LoRA adapter directory for the model in ``model_dir``; returns ``out_dir``.
    ``trust_remote_code``: the engine argument, for a model whose config.json needs its own code."""
    from safetensors.torch import save_file

    from sparrow.model_loader import get_hf_config

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    unknown = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty subset of {', '.join(SUPPORTED_TARGETS)}, got {list(targets)}")
    hf_config = get_hf_config(model_dir, trust_remote_code)
    shapes = projection_shapes(hf_config)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(hf_config.num_hidden_layers):
        for projection in (t for t in SUPPORTED_TARGETS if t in targets):
            in_size, out_size = shapes[projection]
            tensors[peft_tensor_name(layer, projection, "A")] = torch.randn(
                rank, in_size, generator=generator) / in_size ** 0.5
            tensors[peft_tensor_name(layer, projection, "B")] = torch.randn(
                out_size, rank, generator=generator) * (B_GAIN / rank ** 0.5)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets),
        "bias": "none", "use_rslora": use_rslora, "modules_to_save": None, "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def merge_lora_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``model_dir`` with the adapter merged into its weights (``W + scaling * B @ A``,
    computed in float32 and stored in each weight's dtype) to ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import load_file, save_file

    from sparrow.model_loader import iter_safetensors

    config = read_adapter_config(adapter_dir)
    adapter = load_file(str(Path(adapter_dir) / WEIGHTS_FILE))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(model_dir).iterdir():  # config, tokenizer, generation config ...
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy2(item, out / item.name)
    merged: dict[str, torch.Tensor] = {}
    used = set()
    for name, tensor in iter_safetensors(model_dir):
        prefix = name.removesuffix(".weight")
        a_name, b_name = f"base_model.model.{prefix}.lora_A.weight", f"base_model.model.{prefix}.lora_B.weight"
        if name.endswith(".weight") and a_name in adapter:
            delta = config.scaling * (adapter[b_name].float() @ adapter[a_name].float())
            tensor = (tensor.float() + delta).to(tensor.dtype)
            used.update((a_name, b_name))
        merged[name] = tensor.contiguous()
    unused = sorted(set(adapter) - used)
    if unused:
        raise ValueError(f"adapter tensors with no matching model weight: {', '.join(unused[:5])}")
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
