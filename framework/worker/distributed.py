"""torch.distributed start-up for tensor parallelism: one process group per engine, one rank per worker.

The executor decides the rendezvous and hands it to every worker as ``distributed_init_method``:

    tcp://127.0.0.1:PORT   one machine: the executor picked a free port, rank 0 hosts the store
    env://                 several machines: MASTER_ADDR / MASTER_PORT name rank 0's store

Rank and world size are always passed explicitly (never read from RANK / WORLD_SIZE), so a stray
variable in the environment cannot put a worker in the wrong place.

The collectives then run on the platform's device communicator (``Platform.communicator``, a name
registered through ``sparrow_register_device_communicators``; see :mod:`sparrow.distributed`).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any

import torch

from sparrow.layers.parallel import ParallelContext

logger = logging.getLogger(__name__)

ENV_DIST_TIMEOUT = "SPARROW_DIST_TIMEOUT_S"
# A collective that waits longer than this fails instead of hanging (a peer is stuck or gone).
DEFAULT_DIST_TIMEOUT_S = 600.0


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tcp_init_method(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def _check_env_rendezvous() -> None:
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"distributed_init_method 'env://' needs the environment variables {', '.join(missing)} "
            "(the address and port of rank 0's machine)"
        )


def communicator_class(name: str, registry: Any = None) -> type:
    """The device communicator class registered as ``name``; ValueError listing the registered ones."""
    from sparrow.plugins import get_registry, resolve_parser

    registry = registry or get_registry()
    return resolve_parser("device communicator", name, registry.device_communicators)


def init_distributed(platform: Any, rank: int, world_size: int, distributed_init_method: str | None,
                     device: torch.device) -> ParallelContext:
    """Join the tensor-parallel group and return the context the parallel layers use.

    ``platform.dist_backend`` picks the backend (gloo on CPU, nccl on CUDA) and
    ``platform.communicator`` the device communicator the collectives run on. ``None`` as the init
    method means ``env://``. Called once per worker process, from ``WorkerBase.init_device``.
    """
    # Resolved before joining: an unknown name fails this rank alone, not the group's rendezvous.
    comm_name = getattr(platform, "communicator", "torch_distributed")
    try:
        comm_cls = communicator_class(comm_name)
    except ValueError as exc:
        raise ValueError(f"platform {getattr(platform, 'name', platform)!r}: {exc}") from None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    init_method = distributed_init_method or "env://"
    if init_method.startswith("env://"):
        _check_env_rendezvous()
    backend = platform.dist_backend
    if device.type == "cuda":
        # NCCL binds a communicator to the current device: set it before the group exists.
        torch.cuda.set_device(device)
    dist = torch.distributed
    if dist.is_initialized():
        # A worker re-initialised in the same process (tests): the group must be the same shape.
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
    else:
        timeout_s = float(os.environ.get(ENV_DIST_TIMEOUT, DEFAULT_DIST_TIMEOUT_S))
        logger.info("rank %d/%d joining %s group at %s", rank, world_size, backend, init_method)
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    communicator = comm_cls(rank=rank, world_size=world_size, device=device, group=None)
    context = ParallelContext(rank=rank, world_size=world_size, group=None, communicator=communicator)
    # One tiny collective now: connections (and NCCL communicators) are made at start-up, where a
    # misconfigured network fails with a clear error, rather than inside the first forward pass.
    probe = torch.ones(1, device=device)
    context.all_reduce(probe)
    if int(probe.item()) != world_size:
        raise RuntimeError(f"tensor-parallel start-up check failed: {comm_name} all_reduce gave {probe.item()}, "
                           f"expected {world_size}")
    return context
