"""Device communicators: the collectives tensor parallelism runs on, one object per rank.

A platform names its communicator (``Platform.communicator``, default ``"torch_distributed"``);
a worker builds it once when it joins its tensor-parallel group
(:func:`sparrow.worker.distributed.init_distributed`) and every parallel layer reaches it through
:class:`sparrow.layers.parallel.ParallelContext`, which calls it only when the group has more
than one rank. A vendor with its own collective library (HCCL, a fabric of its own) subclasses
:class:`DeviceCommunicator` and registers it::

    @hookimpl
    def sparrow_register_device_communicators(register):
        register("my_ccl", "my_plugin.comm:MyCommunicator")

The process group itself is created by torch.distributed with ``Platform.dist_backend`` before
the communicator is built, so a communicator may use it (the built-in does) or ignore it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

__all__ = ["DeviceCommunicator", "TorchDistributedCommunicator"]


class DeviceCommunicator:
    """One rank's collectives over its tensor-parallel group.

    Built once per worker as ``cls(rank=..., world_size=..., device=..., group=...)`` with
    ``world_size > 1``; ``group`` is the torch.distributed process group (None: the default group).
    Every method is called by every rank of the group in the same order, on tensors of the same
    shape and dtype on ``device``.
    """

    name: ClassVar[str] = ""

    def __init__(self, rank: int, world_size: int, device: torch.device | None = None, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group; the sum is written into ``tensor``, which is returned."""
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order (a new tensor)."""
        raise NotImplementedError

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with the group's first rank's copy; returns ``tensor``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


class TorchDistributedCommunicator(DeviceCommunicator):
    """The built-in: torch.distributed's collectives on the group's backend (gloo, nccl...)."""

    name = "torch_distributed"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        # broadcast's src is a global rank; the group's first member is rank 0 only in the default group.
        first = 0 if self.group is None else torch.distributed.get_global_rank(self.group, 0)
        torch.distributed.broadcast(tensor, src=first, group=self.group)
        return tensor
