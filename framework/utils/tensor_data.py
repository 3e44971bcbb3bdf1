"""torch tensors <-> :class:`sparrow.wire.TensorData`, the form a tensor crosses processes in.

The bytes are the tensor's own, in C order (bfloat16 included: numpy has no bfloat16, so the
conversion goes through an int16 view of the same bytes). Only floating dtypes the model runners
compute in are accepted.
"""

from __future__ import annotations

import torch

from sparrow.wire import TensorData

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The integer type of each dtype's width: its view carries the bytes through numpy unchanged.
_SAME_WIDTH = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def to_tensor_data(tensor: torch.Tensor) -> TensorData:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"a tensor crosses processes as {', '.join(_DTYPES)}, not {name}")
    host = tensor.detach().to("cpu").contiguous()
    data = host.view(_SAME_WIDTH[host.dtype]).numpy().tobytes()
    return TensorData(data=data, dtype=name, shape=list(host.shape))


def from_tensor_data(data: TensorData) -> torch.Tensor:
    """A CPU tensor of ``data``'s dtype and shape (a copy: the message's bytes are read-only)."""
    dtype = _DTYPES.get(data.dtype)
    if dtype is None:
        raise ValueError(f"TensorData.dtype must be one of {', '.join(_DTYPES)}, got {data.dtype!r}")
    flat = torch.frombuffer(bytearray(data.data), dtype=_SAME_WIDTH[dtype]).view(dtype)
    return flat.reshape(data.shape)
