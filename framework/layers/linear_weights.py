"""How a linear layer stores its weight: the "create weights" seam between the linear layers
(``sparrow.layers.linear``) and the quantization methods.

A :class:`LinearWeights` registers a layer's parameters when the layer is built: a dense ``weight``
by default (:data:`DENSE`); a quantization method may give the layers it builds its own (int4
``qweight``/``qzeros``/``scales``, fp8 ``weight`` with ``weight_scale``...) through
:meth:`sparrow.quantization.QuantizationMethod.linear_weights`. Every parameter is registered with
``LinearBase.add_weight`` and a :class:`WeightLayout`, which says which of its dimensions follow the
layer's output and input dimensions (and how many of the layer's rows or columns one stored row
stands for: 8 for a dimension packed eight int4 values per int32, the group size for per-group
scales), so one loader slices every layout per rank and per shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sparrow.layers.linear import LinearBase


def new_tensor(*shape: int, dtype: torch.dtype | None) -> torch.Tensor:
    """A parameter's storage, uninitialised on purpose: every value is overwritten by load_weights."""
    return torch.empty(*shape, dtype=dtype)


@dataclass(slots=True, frozen=True)
class WeightLayout:
    """How one parameter of a linear layer maps onto the layer's ``[out, in]`` matrix.

    ``output_dim`` / ``input_dim``: the parameter's dimension that follows the layer's output rows
    / input columns (None: the parameter is whole on every rank along it, e.g. a per-tensor
    scale). ``output_div`` / ``input_div``: layer rows / columns per stored element along that
    dimension (1 dense, 8 for int4 packed in int32, the group size for per-group scales).
    ``per_shard``: one value per output shard (``[num_shards]``: fp8 per-tensor scales of a
    fused layer, loaded from each projection's scalar)."""

    output_dim: int | None = None
    input_dim: int | None = None
    output_div: int = 1
    input_div: int = 1
    per_shard: bool = False


class LinearWeights:
    """How a linear layer holds its weight: a quantization method's seam into the layers.

    ``create_weights`` registers the parameters (through ``layer.add_weight``) when the layer is
    built; the checkpoint then fills them by name; ``dense_weight`` gives the ``[out, in]`` matrix
    in the layer's dtype, which the torch reference (``forward_native``) multiplies by. An
    implementation of the ``linear`` op (an OpImpl) reads the parameters directly.
    """

    name = "dense"

    def create_weights(self, layer: LinearBase) -> None:
        raise NotImplementedError

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        raise NotImplementedError


class DenseWeights(LinearWeights):
    """One ``weight`` ``[out_per_rank, in_per_rank]`` in the layer's dtype."""

    def create_weights(self, layer: LinearBase) -> None:
        layer.add_weight("weight", new_tensor(layer.output_size_per_rank, layer.input_size_per_rank,
                                              dtype=layer.params_dtype), WeightLayout(output_dim=0, input_dim=1))

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        return layer.weight


DENSE = DenseWeights()
