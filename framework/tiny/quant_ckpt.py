"""Quantized test checkpoints, built locally from an unquantized model directory.

``quantize_model_dir(src, out, ref, method, ...)`` writes ``out``: the model of ``src`` with every
decoder linear weight (``*_proj.weight`` under ``layers.``) stored as a published checkpoint of
that method stores it, and config.json's ``quantization_config`` saying so; and ``ref``: the same
model with those weights replaced by their dequantized values in float32 (what a correct loader
must compute), so that an unquantized run of ``ref`` is the reference of a quantized run of ``out``.

Methods and layouts (written the way the published quantizers write them, independently of
sparrow.quantization's unpacking):

* ``awq``: AutoAWQ's GEMM format: asymmetric 4-bit per group with zero points; ``qweight`` int32
  ``[in, out/8]`` and ``qzeros`` int32 ``[groups, out/8]`` with nibble ``i`` holding column
  ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``; ``scales`` float16 ``[groups, out]``.
* ``gptq``: AutoGPTQ's format: ``bits`` 4 or 8, symmetric (zero point 2^(bits-1)) or not;
  ``qweight`` int32 ``[in / pack, out]`` packed along the input in order, ``qzeros`` int32
  ``[groups, out / pack]`` holding zero - 1, ``scales`` float16, ``g_idx`` int32 ``[in]``. With
  ``desc_act`` the columns are grouped in a permuted order (the same permutation for projections
  that share an input, as GPTQ's Hessian order is). Asymmetric zero points are kept >= 1 because
  this format cannot store a zero point of 0.
* ``fp8``: AutoFP8's format: ``weight`` float8_e4m3fn with a per-tensor float32 ``weight_scale``
  (and ``input_scale`` with ``activation_scheme="static"``).
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Projections that read the same input share GPTQ's act-order permutation.
SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "qkv_proj": "attn_in",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "gate_up_proj": "mlp_in", "w1": "mlp_in", "w3": "mlp_in"}


def _is_decoder_linear(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's linear weight, per-expert ones included (Mixtral's ``experts.N.w1/w2/w3``);
    routers (``mlp.gate``) stay in full precision, as quantizers leave them."""
    if tensor.dim() != 2 or ".layers." not in f".{name}":
        return False
    return name.endswith("_proj.weight") or (".experts." in name and name.endswith((".w1.weight", ".w2.weight",
                                                                                      ".w3.weight")))


def _group_bounds(weight: torch.Tensor, group_of: torch.Tensor, groups: int, sym: bool, bits: int):
    """Per (row, group): scale and integer zero point of ``weight`` [N, K] (float32)."""
    maxq = 2 ** bits - 1
    n = weight.shape[0]
    big = torch.finfo(torch.float32).max
    wmin = torch.full((n, groups), big).scatter_reduce(1, group_of.expand(n, -1), weight, "amin")
    wmax = torch.full((n, groups), -big).scatter_reduce(1, group_of.expand(n, -1), weight, "amax")
    wmin, wmax = wmin.clamp(max=0.0), wmax.clamp(min=0.0)
    if sym:
        bound = torch.maximum(wmin.abs(), wmax)
        scale = (2 * bound / maxq).clamp_min(1e-8)
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = ((wmax - wmin) / maxq).clamp_min(1e-8)
        zero = torch.round(-wmin / scale).clamp(0, maxq)
    return scale, zero


def _quantize_groups(weight: torch.Tensor, group_of: torch.Tensor, groups: int, sym: bool, bits: int,
                     min_zero: int = 0):
    """-> q int64 [N, K], zero int64 [N, G], scale float16 [N, G] and the dequantized float32 [N, K]."""
    scale, zero = _group_bounds(weight, group_of, groups, sym, bits)
    zero = zero.clamp(min=min_zero)
    scale = scale.to(torch.float16)  # stored in float16: quantize with the rounded value
    s, z = scale.float()[:, group_of], zero[:, group_of]
    q = torch.clamp(torch.round(weight / s) + z, 0, 2 ** bits - 1)
    return q.long(), zero.long(), scale, (q - z) * s


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def awq_tensors(weight: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    group_of = torch.arange(k) // g
    q, zero, scale, dequant = _quantize_groups(weight, group_of, k // g, sym=False, bits=4)
    intweight, intzeros = q.t().contiguous(), zero.t().contiguous()  # [K, N], [G, N]
    qweight = torch.zeros(k, n // 8, dtype=torch.int64)
    qzeros = torch.zeros(k // g, n // 8, dtype=torch.int64)
    for nibble, column in enumerate(AWQ_PACK_ORDER):  # AutoAWQ: column 8c + order[i] -> nibble i
        qweight |= intweight[:, column::8] << (4 * nibble)
        qzeros |= intzeros[:, column::8] << (4 * nibble)
    tensors = {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros), "scales": scale.t().contiguous()}
    return tensors, dequant


def act_order_permutation(key: str, k: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randperm(k, generator=generator)


def gptq_tensors(weight: torch.Tensor, group_size: int, bits: int, sym: bool, perm: torch.Tensor | None):
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    per_word = 32 // bits
    position = torch.arange(k)
    if perm is not None:  # column perm[i] is the i-th quantized: its group is i // g
        position = torch.empty(k, dtype=torch.long)
        position[perm] = torch.arange(k)
    g_idx = position // g
    q, zero, scale, dequant = _quantize_groups(weight, g_idx, -(-k // g), sym=sym, bits=bits, min_zero=1)
    intweight, stored_zeros = q.t().contiguous(), (zero - 1).t().contiguous()  # AutoGPTQ stores zero - 1
    qweight = torch.zeros(k // per_word, n, dtype=torch.int64)
    for t in range(per_word):  # rows per_word*r + t -> bits t*bits.. of row r
        qweight |= intweight[t::per_word, :] << (bits * t)
    qzeros = torch.zeros(stored_zeros.shape[0], n // per_word, dtype=torch.int64)
    for t in range(per_word):
        qzeros |= stored_zeros[:, t::per_word] << (bits * t)
    tensors = {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros), "scales": scale.t().contiguous(),
               "g_idx": g_idx.to(torch.int32)}
    return tensors, dequant


def fp8_tensors(weight: torch.Tensor, static: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    fp8 = torch.float8_e4m3fn
    scale = (weight.abs().max() / torch.finfo(fp8).max).clamp_min(1e-12).float()
    q = (weight / scale).clamp(-torch.finfo(fp8).max, torch.finfo(fp8).max).to(fp8)
    tensors = {"weight": q, "weight_scale": scale.reshape(())}
    if static:
        tensors["input_scale"] = torch.tensor(0.05, dtype=torch.float32)
    return tensors, q.float() * scale


def quantize_model_dir(src: str | Path, out: str | Path, ref: str | Path, method: str, *, group_size: int = 32,
                       bits: int = 4, sym: bool = False, desc_act: bool = False,
                       activation_scheme: str = "dynamic") -> tuple[str, str]:
    """Write the ``method`` checkpoint of ``src`` to ``out`` and its dequantized reference to
    ``ref``; returns both paths."""
    from safetensors.torch import load_file, save_file

    src, out, ref = Path(src), Path(out), Path(ref)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _is_decoder_linear(name, tensor):
            quantized[name] = reference[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        weight = tensor.float()
        if method == "awq":
            parts, dequant = awq_tensors(weight, group_size)
        elif method == "gptq":
            layer, _, projection = prefix.rpartition(".")
            perm = act_order_permutation(f"{layer}.{SHARED_INPUT.get(projection, projection)}", weight.shape[1]) \
                if desc_act else None
            parts, dequant = gptq_tensors(weight, group_size, bits, sym, perm)
        elif method == "fp8":
            parts, dequant = fp8_tensors(weight, activation_scheme == "static")
        else:
            raise ValueError(f"unknown method {method!r} (awq, gptq, fp8)")
        quantized.update({f"{prefix}.{key}": value for key, value in parts.items()})
        reference[name] = dequant.to(torch.float32)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quant_config(method, group_size, bits, sym, desc_act, activation_scheme)
    for directory, state in ((out, quantized), (ref, reference)):
        if directory.exists():
            shutil.rmtree(directory)
        shutil.copytree(src, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out), str(ref)


def _quant_config(method: str, group_size: int, bits: int, sym: bool, desc_act: bool,
                  activation_scheme: str) -> dict[str, Any]:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True, "damp_percent": 0.01}
    return {"quant_method": "fp8", "activation_scheme": activation_scheme}
