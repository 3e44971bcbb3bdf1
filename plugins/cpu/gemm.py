"""The ``linear`` and ``lm_head`` ops in fp32 through oneDNN, with weights packed once, when bound.

``F.linear`` on the CPU calls MKL's sgemm, which packs its operands inside every call. At decode
batch sizes (8-64 rows) it is slow: on the 2-vCPU benchmark VM (AMD EPYC) a stack of the
benchmark model's linears runs at 35-100 GFLOP/s through sgemm and at 90-195 GFLOP/s through
oneDNN with the weight reordered once into its blocked layout (about 1.2x at prefill sizes too).
The packed weight is an opaque oneDNN tensor that replaces the layer's dense parameter; a tied LM
head keeps the dense table it shares with the embedding and holds its packed copy itself. New
weights loaded after packing (``model.load_weights``, an RLHF update) are unpacked into, then
packed again; a tied head repacks when the shared table changes.

``SPARROW_CPU_PACKED_LINEAR=0`` turns this off.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from sparrow.ops.base import OpImpl

logger = logging.getLogger(__name__)


def packed_linear_available() -> bool:
    return os.environ.get("SPARROW_CPU_PACKED_LINEAR", "1") != "0" and _onednn_works()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


@functools.lru_cache(maxsize=1)
def _onednn_works() -> bool:
    """Whether this torch build packs and runs an fp32 oneDNN linear correctly (probed once)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        weight, x = torch.randn(24, 16), torch.randn(3, 16)
        got = torch.ops.mkldnn._linear_pointwise(x, _pack(weight), None, "none", [], "")
        ok = torch.allclose(got, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)
    except Exception as exc:  # noqa: BLE001 - an unusual build: keep F.linear
        logger.warning("oneDNN packed linears unavailable, using F.linear: %s", exc)
        return False
    if not ok:
        logger.warning("oneDNN packed linears disagree with F.linear on this build; using F.linear")
    return ok


class OneDnnLinear(OpImpl):
    """``x @ W^T + bias`` with W in oneDNN's packed layout: serves ``linear`` (``(x, bias)``) and
    ``lm_head`` (``(hidden_states)``, fp32 logits) of fp32 layers on the CPU."""

    name = "onednn_packed"

    def __init__(self, layer: Any) -> None:
        super().__init__(layer)
        self.out_features = layer.weight.shape[0]
        self.packed: torch.Tensor | None = None
        self._linear = torch.ops.mkldnn._linear_pointwise  # looked up once, not per call

    @classmethod
    def supports(cls, layer: Any) -> bool:
        weight = getattr(layer, "weight", None)
        return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32
                and weight.device.type == "cpu" and not weight.is_mkldnn and packed_linear_available())

    def process_weights(self) -> None:
        layer = self.layer
        packed = _pack(layer.weight)
        self.tied_version: int | None = None
        if getattr(layer, "tied", False):
            # The embedding reads the dense table it shares with this head: leave it in place, and
            # repack when new weights are loaded into it (its version counter moves).
            self.packed = packed
            self.tied_version = layer.weight._version
        else:
            layer.replace_parameter("weight", packed)  # the dense copy is released
            self.packed = layer.weight

    def unpack_weights(self) -> dict[str, torch.Tensor] | None:
        return {"weight": self.layer.weight.to_dense()} if self.tied_version is None else None

    def release_weights(self) -> int:
        """Sleep level 2: the packed weight (or a tied head's packed copy) is freed."""
        if self.packed is None:
            return 0
        in_features = self.packed.shape[1]
        released = self.out_features * in_features * self.packed.element_size()
        self._dense_shape = (self.out_features, in_features)
        if self.tied_version is None:
            self.layer.replace_parameter("weight", torch.empty(0, dtype=torch.float32))
        self.packed = None
        return released

    def restore_weights(self) -> None:
        if self.packed is not None:
            return
        if self.tied_version is None:
            self.layer.replace_parameter("weight", torch.zeros(self._dense_shape, dtype=torch.float32))
        self.process_weights()  # packs the zeros (a tied head: the table the embedding woke with)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 0:  # oneDNN rejects empty inputs
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.tied_version is not None and self.tied_version != self.layer.weight._version:
            self.process_weights()  # new weights were loaded into the shared table
        return self._linear(x, self.packed, bias, "none", [], "")
