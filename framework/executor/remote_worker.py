"""The launcher of a machine other than node 0 in a multi-node tensor-parallel engine.

Node 0 runs the engine (``LLM``, ``sparrow serve``) with ``SPARROW_NNODES`` set; every other
node runs this launcher, which needs only where node 0 is::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 SPARROW_NODE_RANK=1 python -m sparrow.executor.remote_worker

It connects to node 0's executor socket, receives the engine configuration (so nodes can never
disagree on it; ``--model`` overrides only the model directory's path on this machine), starts
this node's ranks, which join torch.distributed through env:// and take scheduler outputs over
tcp, and exits when they do: 0 after node 0 shut the engine down, 1 when something failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from sparrow.executor import worker_proc as wp
from sparrow.executor.topology import ENV_EXECUTOR_PORT, NodeTopology

logger = logging.getLogger(__name__)

# Once node 0 is gone, how long this node's ranks get to exit by themselves.
_EXIT_GRACE_S = 5.0


class JoinError(RuntimeError):
    """Node 0 refused this node or could not be reached."""


def add_worker_parser(subparsers: Any) -> None:
    """Register ``sparrow worker`` (for ``sparrow.entrypoints.cli``)."""
    parser = subparsers.add_parser(
        "worker", help="run this machine's tensor-parallel ranks for an engine started on node 0")
    add_worker_arguments(parser)
    parser.set_defaults(func=cmd_worker)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    parser.add_argument("--master-addr", default=env.get("MASTER_ADDR"), help="node 0's address (MASTER_ADDR)")
    parser.add_argument("--master-port", type=int, default=_int_or_none(env.get("MASTER_PORT")),
                        help="node 0's torch.distributed port (MASTER_PORT)")
    parser.add_argument("--node-rank", type=int,
                        default=_int_or_none(env.get("SPARROW_NODE_RANK") or env.get("NODE_RANK")),
                        help="this machine's index, 1.. (SPARROW_NODE_RANK)")
    parser.add_argument("--executor-port", type=int, default=_int_or_none(env.get(ENV_EXECUTOR_PORT)),
                        help=f"node 0's executor port ({ENV_EXECUTOR_PORT}; default MASTER_PORT + 1)")
    parser.add_argument("--model", default=None,
                        help="the model directory on this machine, when its path differs from node 0's")
    parser.add_argument("--join-timeout", type=float, default=600.0,
                        help="seconds to wait for node 0's engine to answer")


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


def cmd_worker(args: argparse.Namespace) -> int:
    missing = [flag for flag, value in (("--master-addr", args.master_addr), ("--master-port", args.master_port),
                                        ("--node-rank", args.node_rank)) if value is None]
    if missing:
        print(f"sparrow worker: {', '.join(missing)} (or MASTER_ADDR / MASTER_PORT / SPARROW_NODE_RANK) "
              "must be given", file=sys.stderr)
        return 2
    if args.node_rank < 1:
        print(f"sparrow worker: --node-rank must be >= 1 (node 0 runs the engine), got {args.node_rank}",
              file=sys.stderr)
        return 2
    return run_node(args.master_addr, args.master_port, args.node_rank, executor_port=args.executor_port,
                    model=args.model, join_timeout_s=args.join_timeout)


def run_node(master_addr: str, master_port: int, node_rank: int, executor_port: int | None = None,
             model: str | None = None, join_timeout_s: float = 600.0) -> int:
    """Join node 0's engine, run this node's ranks until they exit; returns the exit code."""
    # This node's ranks join torch.distributed through env://, which reads these; the launcher's
    # own environment is the channel to its spawned children.
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    endpoint = f"tcp://{master_addr}:{executor_port or master_port + 1}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, wp.node_identity(node_rank))
    sock.setsockopt(zmq.LINGER, 0)
    wp.set_heartbeats(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    procs: list[Any] = []
    previous = _install_signal_handlers()
    try:
        reply = _join(sock, node_rank, endpoint, join_timeout_s)
        procs = _start_ranks(reply, node_rank, endpoint, model)
        return _supervise(procs, monitor, endpoint)
    except JoinError as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        logger.warning("interrupted; stopping this node's ranks")
        return 130
    finally:
        _stop(procs)
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _join(sock: zmq.Socket, node_rank: int, endpoint: str, timeout_s: float) -> dict[str, Any]:
    logger.info("node %d: joining the engine at %s", node_rank, endpoint)
    hello = {"node_rank": node_rank, "pid": os.getpid(), "host": socket.gethostname()}
    # A DEALER queues the message until the connection exists, so node 0 may start later.
    sock.send_multipart([wp.JOIN, wp.encode_seq(0), msgspec.msgpack.encode(hello)])
    if not sock.poll(int(timeout_s * 1000)):
        raise JoinError(f"node 0's engine at {endpoint} did not answer within {timeout_s:.0f}s; is it started "
                        "with SPARROW_NNODES set, and is the port reachable?")
    kind, _, payload = sock.recv_multipart()
    reply = msgspec.msgpack.decode(payload)
    if kind != wp.CONFIG or "error" in reply:
        raise JoinError(f"node 0 refused node {node_rank}: {reply.get('error', kind)}")
    return reply


def _start_ranks(reply: dict[str, Any], node_rank: int, endpoint: str, model: str | None) -> list[Any]:
    from sparrow.config import EngineConfig

    config = EngineConfig.model_validate_json(reply["config"])
    if model is not None:
        config = config.model_copy(update={"model": config.model.model_copy(update={"model": model})})
    world_size, nnodes = int(reply["world_size"]), int(reply["nnodes"])
    topology = NodeTopology(nnodes=nnodes, node_rank=node_rank)
    ranks = topology.node_ranks(world_size)
    logger.info("node %d: starting ranks %d..%d of %d", node_rank, ranks[0], ranks[-1], world_size)
    procs = []
    for local_rank, rank in enumerate(ranks):
        spec = wp.WorkerSpec(config=config, rank=rank, local_rank=local_rank, world_size=world_size,
                             local_world_size=len(ranks), distributed_init_method=reply["init_method"],
                             endpoint=endpoint)
        procs.append(wp.spawn_worker(spec))
    return procs


def _supervise(procs: list[Any], monitor: zmq.Socket, endpoint: str) -> int:
    """Wait until every rank has exited, or one failed, or node 0 is gone; returns the exit code."""
    poller = zmq.Poller()
    poller.register(monitor, zmq.POLLIN)
    for proc in procs:
        poller.register(proc.sentinel, zmq.POLLIN)
    while True:
        events = dict(poller.poll(1000))
        if all(proc.exitcode is not None for proc in procs):
            failed = [proc for proc in procs if proc.exitcode != 0]
            return 1 if failed else 0
        for proc in procs:
            if proc.exitcode not in (None, 0):
                logger.error("rank process %d exited with code %s; stopping this node", proc.pid, proc.exitcode)
                return 1
        if monitor in events:
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # Node 0 closed the engine (its ranks exit by themselves right after) or died.
                deadline = time.monotonic() + _EXIT_GRACE_S
                while time.monotonic() < deadline and any(proc.exitcode is None for proc in procs):
                    time.sleep(0.1)
                if all(proc.exitcode == 0 for proc in procs):
                    return 0
                logger.error("lost the connection to node 0 at %s", endpoint)
                return 1


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(_EXIT_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(_EXIT_GRACE_S)
        proc.close()


def _install_signal_handlers() -> dict[int, Any]:
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous: dict[int, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, interrupt)
    return previous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparrow.executor.remote_worker",
                                     description="Run this machine's ranks of a multi-node Sparrow engine.")
    parser.add_argument("--log-level", default="INFO")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(levelname)s %(asctime)s [node launcher pid={os.getpid()}] %(name)s: %(message)s")
    return cmd_worker(args)


if __name__ == "__main__":
    sys.exit(main())
