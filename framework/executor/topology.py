"""Where the ranks of one engine live: one machine, or several joined through env:// rendezvous.

Multi-node runs are configured by environment variables, the same ones torchrun uses, so that a
job scheduler (Slurm, Kubernetes) can start every node with one command line; on node 0 the engine
arguments ``nnodes``, ``master_addr`` and ``master_port`` override them:

    SPARROW_NNODES (or NNODES)        machines in the tensor-parallel group (default 1)
    SPARROW_NODE_RANK (or NODE_RANK)  this machine's index; the engine runs on node 0
    MASTER_ADDR, MASTER_PORT          node 0's address and torch.distributed store port
    SPARROW_EXECUTOR_PORT             node 0's port for scheduler outputs (default MASTER_PORT + 1)

Ranks are laid out node by node: node n runs ranks ``n * k .. n * k + k - 1`` with
``k = world_size / nnodes``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_NNODES = ("SPARROW_NNODES", "NNODES")
ENV_NODE_RANK = ("SPARROW_NODE_RANK", "NODE_RANK")
ENV_EXECUTOR_PORT = "SPARROW_EXECUTOR_PORT"


def _read_int(env: Mapping[str, str], names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None
    return default


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, on Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def core_share(processes_on_machine: int) -> int:
    """Cores per process when ``processes_on_machine`` processes compute on this machine at once:
    each using every core would oversubscribe the CPU and slow every collective down."""
    return max(1, usable_cores() // max(1, processes_on_machine))


def nnodes_from_env(env: Mapping[str, str] | None = None) -> int:
    """Machines in the tensor-parallel group as the environment says (1 when unset)."""
    return _read_int(os.environ if env is None else env, ENV_NNODES, 1) or 1


@dataclass(slots=True, frozen=True)
class NodeTopology:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    executor_port: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, nnodes: int | None = None,
                 master_addr: str | None = None, master_port: int | None = None) -> NodeTopology:
        """The environment's topology; arguments that are not None (engine arguments) win."""
        env = os.environ if env is None else env
        if nnodes is None:
            nnodes = _read_int(env, ENV_NNODES, 1)
        node_rank = _read_int(env, ENV_NODE_RANK, 0)
        if master_port is None:
            master_port = _read_int(env, ("MASTER_PORT",), None)
        executor_port = _read_int(env, (ENV_EXECUTOR_PORT,), None)
        assert nnodes is not None and node_rank is not None  # read with defaults
        topology = cls(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr or env.get("MASTER_ADDR") or None,
                       master_port=master_port, executor_port=executor_port)
        topology.validate()
        return topology

    def validate(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"SPARROW_NNODES must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"SPARROW_NODE_RANK must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            missing = [name for name, value in (("master_addr (MASTER_ADDR)", self.master_addr),
                                                ("master_port (MASTER_PORT)", self.master_port)) if value is None]
            if missing:
                raise ValueError(f"a multi-node run (nnodes={self.nnodes}) needs {', '.join(missing)}: "
                                 "node 0's address and a free port on it")

    @property
    def is_multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def resolved_executor_port(self) -> int:
        if self.executor_port is not None:
            return self.executor_port
        if self.master_port is None:
            raise ValueError("MASTER_PORT is not set")
        return self.master_port + 1

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.nnodes != 0:
            raise ValueError(
                f"tensor_parallel_size ({world_size}) must be divisible by the number of nodes "
                f"(SPARROW_NNODES={self.nnodes})"
            )
        return world_size // self.nnodes

    def node_ranks(self, world_size: int, node_rank: int | None = None) -> range:
        """The global ranks that run on ``node_rank`` (default: this node)."""
        k = self.ranks_per_node(world_size)
        node = self.node_rank if node_rank is None else node_rank
        return range(node * k, node * k + k)
