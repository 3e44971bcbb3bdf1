"""Tensor-parallel context passed explicitly to every parallel layer.

A layer that receives ``tp=None`` (or a context of world size 1) runs exactly as a plain torch
layer: the collective helpers return their input untouched, so a single device pays nothing.
With several ranks they delegate to the context's device communicator
(:class:`sparrow.distributed.DeviceCommunicator`, the platform's choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True, frozen=True)
class ParallelContext:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup, or None for the default group
    # A sparrow.distributed.DeviceCommunicator; None with several ranks: the built-in
    # torch_distributed one over ``group``.
    communicator: Any = None
    # vLLM's enable_expert_parallel: mixture-of-experts layers split their experts over the ranks
    # (each holds whole experts) instead of every expert's intermediate size.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"ParallelContext.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"ParallelContext.rank must be in [0, {self.world_size}), got {self.rank}"
            )
        if self.communicator is None and self.world_size > 1:
            from sparrow.distributed import TorchDistributedCommunicator

            # frozen: the default is filled once, here
            object.__setattr__(self, "communicator",
                               TorchDistributedCommunicator(self.rank, self.world_size, group=self.group))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; a no-op for world size 1."""
        if self.world_size == 1:
            return tensor
        return self.communicator.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` in rank order; identity for world size 1."""
        if self.world_size == 1:
            return tensor
        return self.communicator.all_gather(tensor, dim=dim)

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with the group's first rank's copy, in place;
        a no-op for world size 1."""
        if self.world_size == 1:
            return tensor
        return self.communicator.broadcast_from_first(tensor)


SINGLE_DEVICE = ParallelContext()


def resolve_tp(tp: ParallelContext | None) -> ParallelContext:
    """``tp`` itself, or the single-device context for None."""
    return SINGLE_DEVICE if tp is None else tp


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, raising an error naming ``what`` unless it divides exactly."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by the tensor parallel size ({denominator})"
        )
    return numerator // denominator


# ---------------------------------------------------------------------------------------------
# Weight loading. A loaded weight is a torch.Tensor or a lazy safetensors slice (what
# ``safe_open(...).get_slice(name)`` returns), so that a rank reads only the rows it keeps.
# ---------------------------------------------------------------------------------------------


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a loaded tensor or safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def materialize(loaded: Any) -> torch.Tensor:
    """The whole of a loaded tensor or safetensors slice as a tensor."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[...]  # not [:], which a 0-dim slice (an fp8 checkpoint's per-tensor scale) refuses


def narrow_loaded(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows ``start:start+length`` along ``dim``, reading only those from a safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param`` (casting dtype); a shape mismatch raises ValueError."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} does not match the model's {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def default_weight_loader(param: torch.nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """Loader of a replicated parameter: the checkpoint tensor is copied whole."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter takes no shard_id, got {shard_id!r}")
    copy_checked(param, materialize(loaded))
