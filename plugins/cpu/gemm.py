"""fp32 linear layers through oneDNN with weights packed once, after loading.

``F.linear`` on the CPU calls MKL's sgemm, which packs its operands inside every call. At decode
batch sizes (8-64 rows) it is slow: on the 2-vCPU benchmark VM (AMD EPYC) a stack of the
benchmark model's linears runs at 35-100 GFLOP/s through sgemm and at 90-195 GFLOP/s through
oneDNN with the weight reordered once into its blocked layout (about 1.2x at prefill sizes too). The packed weight is an opaque oneDNN tensor; the dense copy is released
unless another module shares it (a tied LM head keeps the embedding table it shares).

``SPARROW_CPU_PACKED_LINEAR=0`` turns this off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn

from sparrow.layers.linear import PlatformGemm

logger = logging.getLogger(__name__)


def packed_linear_available() -> bool:
    return os.environ.get("SPARROW_CPU_PACKED_LINEAR", "1") != "0" and _onednn_works()


@functools.lru_cache(maxsize=1)
def _onednn_works() -> bool:
    """Whether this torch build packs and runs an fp32 oneDNN linear correctly (probed once)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        weight, x = torch.randn(24, 16), torch.randn(3, 16)
        got = OneDnnLinear(weight)(x, None)
        ok = torch.allclose(got, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)
    except Exception as exc:  # noqa: BLE001 - an unusual build: keep F.linear
        logger.warning("oneDNN packed linears unavailable, using F.linear: %s", exc)
        return False
    if not ok:
        logger.warning("oneDNN packed linears disagree with F.linear on this build; using F.linear")
    return ok


class OneDnnLinear:
    """``x @ W^T + bias`` with W in oneDNN's packed layout."""

    __slots__ = ("packed", "out_features")

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] == 0:  # oneDNN rejects empty inputs
            return x.new_empty(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _weight_was_packed(*_args, **_kwargs) -> None:
    raise RuntimeError("this weight was packed for oneDNN after loading; build a new model to load weights again")


def pack_linear_weights(model: nn.Module) -> int:
    """Route every fp32 linear layer of ``model`` through oneDNN; returns how many were packed."""
    if not packed_linear_available():
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not isinstance(module, PlatformGemm) or weight is None or weight.dim() != 2
                or weight.dtype != torch.float32 or weight.device.type != "cpu"):
            continue
        module.gemm_override = OneDnnLinear(weight)
        if owners[id(weight)] == 1:
            # Keep the shape (parameter counts, repr) without the memory.
            placeholder = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                       requires_grad=False)
            placeholder.weight_loader = _weight_was_packed
            module.weight = placeholder
        packed += 1
    logger.debug("packed %d linear weights for oneDNN", packed)
    return packed
