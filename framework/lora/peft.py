"""PEFT adapter directories: ``adapter_config.json`` checks (torch-free) and weight loading.

A directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ``bias``, ``modules_to_save``) and ``adapter_model.safetensors`` with PEFT's names::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

The scaling is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). Every refusal is a
ValueError that names the key of ``adapter_config.json`` (or the tensor) at fault.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparrow.hub_cache import local_or_cached

# The projections of the llama-family decoder an adapter may target.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# Architectures (config.json ``architectures``) whose decoder is sparrow.models.llama's with these
# projections; other decoders (mixtures of experts, fused checkpoints, Gemma) have no LoRA path yet.
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What the engine uses of ``adapter_config.json``."""

    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    scaling: float


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's weights on the host: (layer index, projection) -> (A [r, in], B [out, r])."""

    name: str
    int_id: int
    path: str
    config: AdapterConfig
    modules: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def scaling(self) -> float:
        return self.config.scaling


def _fail(path: Path, key: str, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} {key!r} {message}")


def read_adapter_config(path: str | Path, max_lora_rank: int | None = None) -> AdapterConfig:
    """Read and check ``adapter_config.json``; ValueError naming the key (or the missing file).
    ``path``: a directory, or a Hub id in the Hugging Face cache (``sparrow.hub_cache``)."""
    directory = local_or_cached(str(path))
    config_path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise ValueError(f"lora_path {str(path)!r} is not a directory (expected a PEFT adapter directory, or a Hub "
                         "id already in the Hugging Face cache)")
    if not config_path.is_file():
        raise ValueError(f"lora_path {str(path)!r} has no {CONFIG_FILE}, so it is not a PEFT adapter directory")
    if not (directory / WEIGHTS_FILE).is_file():
        raise ValueError(f"lora_path {str(path)!r} has no {WEIGHTS_FILE} (other weight formats are not read)")
    try:
        raw = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} must hold a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(directory, "peft_type", f"is {peft_type!r}; only LORA adapters are served")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(directory, "r", f"must be a positive integer, got {rank!r}")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise _fail(directory, "r", f"is {rank}, more than max_lora_rank={max_lora_rank}; raise max_lora_rank "
                    "to serve it")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _fail(directory, "lora_alpha", f"must be a number, got {alpha!r}")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise _fail(directory, "bias", f"is {bias!r}; only adapters without bias terms ('none') are served")
    modules_to_save = raw.get("modules_to_save")
    if modules_to_save:
        raise _fail(directory, "modules_to_save", f"is {modules_to_save!r}; adapters that replace whole modules "
                    "are not served (it must be empty)")
    for key in ("use_dora", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise _fail(directory, key, f"is {raw[key]!r}; not supported (it must be unset or empty)")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets in SUPPORTED_TARGETS else None
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _fail(directory, "target_modules", f"must be a list of projection names among "
                    f"{', '.join(SUPPORTED_TARGETS)}, got {raw.get('target_modules')!r}")
    unknown = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if unknown:
        raise _fail(directory, "target_modules", f"names {', '.join(map(repr, unknown))}; supported: "
                    f"{', '.join(SUPPORTED_TARGETS)}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    ordered = tuple(t for t in SUPPORTED_TARGETS if t in targets)
    return AdapterConfig(rank=rank, lora_alpha=float(alpha), target_modules=ordered, scaling=float(scaling))


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """projection -> (in, out) of each whole projection of the llama-family decoder in ``hf_config``."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q_size = hf_config.num_attention_heads * head_dim
    kv_size = hf_config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """tensor name -> shape, from a safetensors file's JSON header (no tensor is read)."""
    try:
        with open(file, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if not 0 < header_len <= 100_000_000:
                raise ValueError(f"header length {header_len}")
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(file)!r} is not a readable safetensors file: {exc}") from None
    return {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}


def check_adapter_tensors(path: str | Path, config: AdapterConfig, shapes: dict[str, tuple[int, ...]],
                          num_layers: int, module_shapes: dict[str, tuple[int, int]],
                          ) -> dict[tuple[int, str], dict[str, str]]:
    """Check every tensor's name and shape against the model (``module_shapes``: projection ->
    (in, out)); returns (layer, projection) -> {"A": tensor name, "B": tensor name}."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for tensor_name, shape in shapes.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {tensor_name!r} is not a LoRA weight of a "
                             "decoder projection (expected base_model.model.model.layers.N.<self_attn|mlp>."
                             "<proj>.lora_<A|B>.weight)")
        layer, projection, half = int(match[1]), match[3], match[4]
        if projection not in config.target_modules:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {tensor_name!r} is for {projection!r}, which "
                             f"{CONFIG_FILE} 'target_modules' does not list")
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {tensor_name!r} is for layer {layer}, but the "
                             f"model has {num_layers} layers")
        in_size, out_size = module_shapes[projection]
        expected = (config.rank, in_size) if half == "A" else (out_size, config.rank)
        if tuple(shape) != expected:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {tensor_name!r} has shape {tuple(shape)}, "
                             f"expected {expected} (r={config.rank} in {CONFIG_FILE}, and the model's sizes)")
        pairs.setdefault((layer, projection), {})[half] = tensor_name
    for (layer, projection), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {projection} has no {missing} weight")
    if not pairs:
        raise ValueError(f"LoRA adapter {str(path)!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return pairs


def check_adapter(path: str | Path, *, max_lora_rank: int, hf_config: Any) -> AdapterConfig:
    """The frontend's check of an adapter directory against the model, reading only the config
    and the weights' header; ValueError naming the key or tensor at fault."""
    config = read_adapter_config(path, max_lora_rank)
    shapes = safetensors_shapes(local_or_cached(str(path)) / WEIGHTS_FILE)
    check_adapter_tensors(path, config, shapes, hf_config.num_hidden_layers, projection_shapes(hf_config))
    return config


def load_adapter(name: str, int_id: int, path: str, *, max_lora_rank: int, num_layers: int,
                 module_shapes: dict[str, tuple[int, int]]) -> LoRAWeights:
    """Read an adapter's weights (float32, on the host), checked against the model."""
    from safetensors.torch import load_file

    config = read_adapter_config(path, max_lora_rank)
    tensors = load_file(str(local_or_cached(path) / WEIGHTS_FILE), device="cpu")
    pairs = check_adapter_tensors(path, config, {n: tuple(t.shape) for n, t in tensors.items()}, num_layers,
                                  module_shapes)
    weights = LoRAWeights(name=name, int_id=int_id, path=str(path), config=config)
    for key, pair in pairs.items():
        weights.modules[key] = (tensors[pair["A"]].float().contiguous(), tensors[pair["B"]].float().contiguous())
    return weights


def check_lora_architecture(hf_config: Any) -> None:
    """Raise ValueError naming ``enable_lora`` when the model's architecture has no LoRA path."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not any(arch in LORA_ARCHITECTURES for arch in architectures):
        raise ValueError(f"enable_lora: architecture {', '.join(architectures) or '(none)'} has no LoRA support; "
                         f"supported: {', '.join(LORA_ARCHITECTURES)}")
