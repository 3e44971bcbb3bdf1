"""Rotary position embeddings (RoPE), applied by a positions tensor through a cos/sin cache.

The rotation is the "neox" layout Hugging Face Llama/Qwen checkpoints use: the first and second
halves of the rotated dimensions form the pairs. Scaling types: ``default``, ``linear`` and
``llama3`` (Llama 3.1's frequency-dependent interpolation). ``dynamic`` NTK is not offered: its
frequencies depend on the whole sequence length, which a paged cache of already-rotated keys
cannot follow.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sparrow.ops.base import CustomOp

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one flat dict with ``rope_type`` and ``rope_theta``.

    Accepts transformers 5 ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``
    (whose type key may be ``type`` or ``rope_type``).
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(scaling, dict):
        params = dict(scaling)
    params.setdefault("rope_type", params.pop("type", None) or "default")
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


def _require(params: dict[str, Any], key: str) -> float:
    if params.get(key) is None:
        raise ValueError(f"rope_scaling of type {params['rope_type']!r} needs the field {key!r}")
    return params[key]


class RotaryEmbedding(CustomOp):
    """Rotates the first ``rotary_dim`` dims of each query/key head by its token's position."""

    op_name = "rotary_embedding"

    def __init__(self, head_dim: int, rotary_dim: int, inv_freq: torch.Tensor, max_position: int) -> None:
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
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, rotary_dim] float32
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


def get_rope(hf_config: Any, head_dim: int, max_position: int | None = None) -> RotaryEmbedding:
    """The rotary embedding a Hugging Face config describes."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    config_max_position = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_position = max_position or config_max_position
    rotary_dim = int(head_dim * params["partial_rotary_factor"])
    inv_freq = default_inv_freq(rotary_dim, float(params["rope_theta"]))
    if rope_type == "linear":
        inv_freq = inv_freq / _require(params, "factor")
    elif rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, params, config_max_position)
    return RotaryEmbedding(head_dim, rotary_dim, inv_freq, max_position)
