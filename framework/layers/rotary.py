"""Rotary position embeddings (RoPE), applied by a positions tensor through a cos/sin cache.

The rotation is the "neox" layout Hugging Face Llama/Qwen checkpoints use: the first and second
halves of the rotated dimensions form the pairs. Scaling types: ``default``, ``linear``,
``llama3`` (Llama 3.1's frequency-dependent interpolation), ``longrope`` (Phi-3's per-frequency
factors, formerly ``su``) and ``yarn`` (Qwen's long-context setting: YaRN, Peng et al. 2023).
``dynamic`` NTK is not offered: its frequencies depend on the whole
sequence length, which a paged cache of already-rotated keys cannot follow. For the same reason
``longrope`` picks its factors by position, as vLLM does: the short factors below
``original_max_position_embeddings``, the long ones from there on (transformers switches every
position of a sequence to the long factors once the sequence passes that length, so the two agree
on every sequence up to it).

Models whose layer kinds use different RoPE (Gemma 3: ``rope_parameters`` keyed by
``sliding_attention`` / ``full_attention``) pass ``layer_type``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sparrow.ops.base import CustomOp

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE parameters as one flat dict with ``rope_type`` and ``rope_theta``.

    Accepts transformers 5 ``rope_parameters`` (flat, or keyed by ``layer_type``) and the older
    ``rope_theta`` + ``rope_scaling`` (whose type key may be ``type`` or ``rope_type``).
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(scaling, dict):
        params = dict(scaling)
    params.setdefault("rope_type", params.pop("type", None) or "default")
    if params["rope_type"] == "su":  # LongRoPE's first name in Phi-3 configs
        params["rope_type"] = "longrope"
    if params.get("rope_theta") is None and layer_type == "sliding_attention":
        params["rope_theta"] = getattr(hf_config, "rope_local_base_freq", None)  # Gemma 3, older configs
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return params


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # [rotary_dim // 2] float32
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (base ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    factor = _require(params, "factor")
    low_freq_factor = _require(params, "low_freq_factor")
    high_freq_factor = _require(params, "high_freq_factor")
    old_context_len = params.get("original_max_position_embeddings") or max_position
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freqs(rotary_dim: int, params: dict[str, Any], hf_config: Any
                       ) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """LongRoPE (Phi-3): ``(short inv_freq, long inv_freq, original_max_position_embeddings,
    attention_scaling)``; each frequency is divided by its own factor from the config's lists."""
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None)
    if original is None:
        raise ValueError("rope_scaling of type 'longrope' needs the field 'original_max_position_embeddings'")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    base_powers = float(params["rope_theta"]) ** exponents
    inv_freqs = []
    for key in ("short_factor", "long_factor"):
        factors = _require(params, key)
        if not isinstance(factors, (list, tuple)) or len(factors) != rotary_dim // 2:
            raise ValueError(f"rope_scaling field {key!r} must be a list of {rotary_dim // 2} numbers")
        inv_freqs.append(1.0 / (torch.tensor(factors, dtype=torch.float32) * base_powers))
    factor = params.get("factor")
    if factor is None:  # Phi-3 stores the extended length, not the factor
        factor = (getattr(hf_config, "max_position_embeddings", None) or original) / original
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freqs[0], inv_freqs[1], int(original), float(scaling)


def yarn_inv_freq(rotary_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    divided by ``factor`` (interpolated), those that turn more than ``beta_fast`` times are kept,
    and the dimensions between blend linearly; every cos and sin is scaled by the attention factor
    (``0.1 * ln(factor) + 1`` unless given). Returns the frequencies and that factor."""
    base = float(params["rope_theta"])
    original = params.get("original_max_position_embeddings") or max_position
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the extended to the original context
        factor = max_position / original
    factor = float(factor)

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        weight, weight_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, weight) / mscale(factor, weight_all) if weight and weight_all \
            else mscale(factor)

    def dimension_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` turns
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(params.get("beta_fast") or 32), dimension_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    wavelength_scale = base ** exponents
    kept, interpolated = 1.0 / wavelength_scale, 1.0 / (factor * wavelength_scale)
    keep = 1 - ramp
    return interpolated * (1 - keep) + kept * keep, float(attention_factor)


def _require(params: dict[str, Any], key: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope_scaling of type {params['rope_type']!r} needs the field {key!r}")
    return params[key]


class RotaryEmbedding(CustomOp):
    """Rotates the first ``rotary_dim`` dims of each query/key head by its token's position."""

    op_name = "rotary_embedding"

    def __init__(self, head_dim: int, rotary_dim: int, inv_freq: torch.Tensor, max_position: int, *,
                 long_inv_freq: torch.Tensor | None = None, long_from: int | None = None,
                 attention_scaling: float = 1.0) -> None:
        """``long_inv_freq`` replaces ``inv_freq`` for positions from ``long_from`` on (LongRoPE);
        ``attention_scaling`` multiplies every cos and sin."""
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and <= head_dim {head_dim}, got {rotary_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        # Angles are formed as transformers forms them (float32 position * inv_freq), on the CPU,
        # then moved to the device the model is being built on.
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq.cpu()[None, :]  # [max_position, rotary_dim // 2]
        if long_inv_freq is not None and long_from is not None and long_from < max_position:
            freqs[long_from:] = positions[long_from:, None] * long_inv_freq.cpu()[None, :]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, rotary_dim] float32
        if attention_scaling != 1.0:
            cos_sin = cos_sin * attention_scaling
        self.register_buffer("cos_sin_cache", cos_sin.to(torch.get_default_device()), persistent=False)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; query [T, Hq, head_dim]; key [T, Hkv, head_dim] -> rotated copies.

        The torch reference (never in place); a platform's implementation may rotate in place."""
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)  # each [T, 1, rotary_dim // 2]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > self.rotary_dim:  # partial rotary: the tail dims pass through
            rotated = self._rotate(x[..., : self.rotary_dim], cos, sin)
            return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def layer_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


def get_rope(hf_config: Any, head_dim: int, max_position: int | None = None,
             layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary embedding a Hugging Face config describes (for layers of ``layer_type``)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} (config.json rope_parameters/rope_scaling) is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    config_max_position = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_position = max_position or config_max_position
    rotary_dim = int(head_dim * params["partial_rotary_factor"])
    if rope_type == "longrope":
        short, long, original, scaling = longrope_inv_freqs(rotary_dim, params, hf_config)
        return RotaryEmbedding(head_dim, rotary_dim, short, max_position, long_inv_freq=long,
                               long_from=original, attention_scaling=scaling)
    if rope_type == "yarn":
        inv_freq, scaling = yarn_inv_freq(rotary_dim, params, config_max_position)
        return RotaryEmbedding(head_dim, rotary_dim, inv_freq, max_position, attention_scaling=scaling)
    inv_freq = default_inv_freq(rotary_dim, float(params["rope_theta"]))
    if rope_type == "linear":
        inv_freq = inv_freq / _require(params, "factor")
    elif rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, params, config_max_position)
    return RotaryEmbedding(head_dim, rotary_dim, inv_freq, max_position)
