"""MultiprocExecutor: one process per tensor-parallel rank, driven from the engine-core process.

    engine core (P1)                                   rank processes (P2..)
    execute_model(so) --EXECUTE so--> ROUTER ==ipc/tcp==> DEALER rank-0 .. rank-N
                      <--OUTPUT (rank 0 only)---------    each runs the same step; the layers'
    collective_rpc    --RPC--> every rank, RESULT back    collectives (gloo / NCCL) tie them

Every wait polls the socket together with the local ranks' process sentinels and the socket's
disconnect events, in slices of at most a second, so a rank that dies, crashes or is cut off is
reported as an error naming it, promptly, and an engine step never hangs on a dead peer. A
failure during a step is fatal (the ranks may no longer agree on their state); a failed RPC is
raised to its caller only.

Ranks on other machines (``SPARROW_NNODES`` > 1, see ``sparrow.executor.topology``) connect over
tcp after their node's launcher (``sparrow.executor.remote_worker``) asked for the configuration.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import tempfile
import time
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from sparrow.config import EngineConfig
from sparrow.core.sched.output import SchedulerOutput
from sparrow.executor import rpc
from sparrow.executor import worker_proc as wp
from sparrow.executor.abstract import Executor, KVCacheInfo
from sparrow.executor.topology import NodeTopology
from sparrow.worker.distributed import get_open_port, tcp_init_method
from sparrow.worker.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)

ENV_EXECUTE_TIMEOUT = "SPARROW_EXECUTE_MODEL_TIMEOUT_S"
ENV_START_TIMEOUT = "SPARROW_WORKER_START_TIMEOUT_S"
_POLL_SLICE_MS = 1000
# A rank's failure is often the echo of another rank's death (its collective lost the peer):
# wait this long for a death to show before blaming the rank that reported.
_DEATH_GRACE_S = 1.0
_SHUTDOWN_GRACE_S = 5.0


class WorkerDiedError(RuntimeError):
    """A worker process died, failed a step, or became unreachable; the executor is unusable."""


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel.tensor_parallel_size
        parallel = config.parallel
        self.topology = NodeTopology.from_env(nnodes=parallel.nnodes, master_addr=parallel.master_addr,
                                              master_port=parallel.master_port)
        if self.topology.node_rank != 0:
            raise ValueError(
                f"the engine runs on node 0 but SPARROW_NODE_RANK is {self.topology.node_rank}; "
                "start the other nodes with `python -m sparrow.executor.remote_worker`"
            )
        self.local_ranks = self.topology.node_ranks(self.world_size, 0)
        self.execute_timeout_s = float(os.environ.get(ENV_EXECUTE_TIMEOUT, "600"))
        self.start_timeout_s = float(os.environ.get(ENV_START_TIMEOUT, "600"))
        self._procs: dict[int, Any] = {}  # rank -> process (sparrow.engine.launch.ChildProcess)
        self._ranks_info: dict[int, dict[str, Any]] = {}  # rank -> HELLO info
        self._joined_nodes: set[int] = set()
        # seq -> {rank -> payload} of every call still awaited: several steps may be in flight
        # (overlapped scheduling); a reply to a call nobody waits for any more is dropped.
        self._pending: dict[int, dict[int, bytes]] = {}
        self._failures: list[tuple[int, int, str, str]] = []  # (rank, seq, kind, traceback)
        self._seqs = itertools.count(1)
        self._dead_reason: str | None = None
        self._remote_lost: str | None = None
        self._closed = False
        self._started = False
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._generic_decoder = msgspec.msgpack.Decoder()

    # -- start-up ---------------------------------------------------------------------------
    def initialize(self) -> KVCacheInfo:
        try:
            self._open_sockets()
            self._start_local_workers()
            self._wait_for_ranks()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
            # Every rank must hold the same number of blocks (the scheduler hands out one set of
            # block ids); the rank with the least memory decides.
            num_blocks = min(self.collective_rpc("determine_num_kv_blocks"))
            self.collective_rpc("initialize_kv_cache", (num_blocks,))
            block_size = self.collective_rpc("block_size")[0]
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d tensor-parallel workers ready on %d node(s): %d KV blocks of %d tokens",
                    self.world_size, self.topology.nnodes, num_blocks, block_size)
        return KVCacheInfo(num_blocks=int(num_blocks), block_size=int(block_size))

    def _open_sockets(self) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="sparrow-workers-")
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        # Sending to a rank that is gone raises at once instead of dropping the message.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        wp.set_heartbeats(self._router)
        self._ipc_endpoint = f"ipc://{self._tmpdir}/workers.sock"
        self._router.bind(self._ipc_endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._monitor = None
        if self.topology.is_multi_node:
            port = self.topology.resolved_executor_port
            self._router.bind(f"tcp://*:{port}")
            self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._poller.register(self._monitor, zmq.POLLIN)
            logger.info("waiting for %d other node(s) on tcp port %d", self.topology.nnodes - 1, port)
        self._started = True

    def _start_local_workers(self) -> None:
        if self.topology.is_multi_node:
            # node 0's store, which the other nodes reach through env:// (MASTER_ADDR / MASTER_PORT)
            assert self.topology.master_addr is not None and self.topology.master_port is not None  # validated
            init_method = tcp_init_method(self.topology.master_addr, self.topology.master_port)
        else:
            init_method = tcp_init_method("127.0.0.1", get_open_port())
        for local_rank, rank in enumerate(self.local_ranks):
            spec = wp.WorkerSpec(config=self.config, rank=rank, local_rank=local_rank, world_size=self.world_size,
                                 local_world_size=len(self.local_ranks), distributed_init_method=init_method,
                                 endpoint=self._ipc_endpoint)
            proc = wp.spawn_worker(spec)
            self._procs[rank] = proc
            self._poller.register(proc.sentinel, zmq.POLLIN)

    def _wait_for_ranks(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while len(self._ranks_info) < self.world_size:
            self._raise_failures(fatal=True, what="worker start-up")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(self._ranks_info))
                hint = ""
                if any(rank not in self.local_ranks for rank in missing):
                    hint = (f"; start `python -m sparrow.executor.remote_worker` on the other nodes with "
                            f"MASTER_ADDR={self.topology.master_addr} MASTER_PORT={self.topology.master_port} "
                            "and SPARROW_NODE_RANK=1.. (see docs/distributed.md)")
                raise WorkerDiedError(f"worker ranks {missing} did not start within {self.start_timeout_s:.0f}s "
                                      f"({ENV_START_TIMEOUT}){hint}")
            self._pump(min(remaining * 1000, _POLL_SLICE_MS))

    # -- the step and utility calls ---------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Send the step to every rank and return at once; the ranks run steps in the order sent,
        and each feeds the tokens it sampled to the next step itself."""
        seq = self._send_all(wp.EXECUTE, self._encoder.encode(scheduler_output))
        return PendingStep(self, seq)

    def _step_result(self, seq: int) -> ModelRunnerOutput:
        replies = self._wait_replies(seq, {0}, self.execute_timeout_s, "execute_model", fatal=True)
        return self._output_decoder.decode(replies[0])

    def collective_rpc(self, method: str | bytes, args: tuple = (), kwargs: dict | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        """``worker.method(*args, **kwargs)`` on every rank, results in rank order. Arguments and
        results cross processes as msgpack (builtins, msgspec Structs and dataclasses)."""
        from sparrow.engine.serial import decode_result

        payload = self._encoder.encode([method, list(args), dict(kwargs or {})])
        seq = self._send_all(wp.RPC, payload)
        replies = self._wait_replies(seq, set(range(self.world_size)), timeout_s,
                                     f"collective_rpc({rpc.describe(method)})", fatal=False)
        return [decode_result(self._generic_decoder.decode(replies[rank])) for rank in range(self.world_size)]

    def check_health(self) -> None:
        self._ensure_usable()
        self._check_liveness()

    # -- messaging --------------------------------------------------------------------------
    def _ensure_usable(self) -> None:
        if self._dead_reason is not None:
            raise WorkerDiedError(self._dead_reason)
        if self._closed or not self._started:
            raise WorkerDiedError("the executor is shut down" if self._closed else "the executor is not started")

    def _send_all(self, kind: bytes, payload: bytes) -> int:
        self._ensure_usable()
        seq = next(self._seqs)
        self._pending[seq] = {}
        seq_frame = wp.encode_seq(seq)
        for rank in range(self.world_size):
            try:
                self._router.send_multipart([wp.rank_identity(rank), kind, seq_frame, payload], copy=False)
            except zmq.ZMQError as exc:
                self._check_liveness()
                self._die(f"worker rank {rank} is unreachable ({exc})")
        return seq

    def _wait_replies(self, seq: int, ranks: set[int], timeout_s: float | None, what: str,
                      fatal: bool) -> dict[int, bytes]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        replies = self._pending[seq]
        try:
            while not ranks <= replies.keys():
                self._raise_failures(fatal=fatal, what=what, seq=seq)
                wait_ms: float = _POLL_SLICE_MS
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        message = f"{what} got no answer from ranks {sorted(ranks - replies.keys())} " \
                                  f"within {timeout_s:g}s"
                        if fatal:
                            self._die(message + f" ({ENV_EXECUTE_TIMEOUT})")
                        raise TimeoutError(message)
                    wait_ms = min(wait_ms, remaining * 1000)
                self._pump(wait_ms)
            self._raise_failures(fatal=fatal, what=what, seq=seq)
        finally:
            self._pending.pop(seq, None)  # answered or given up on: later replies are dropped
        return replies

    def _pump(self, timeout_ms: float) -> None:
        """Wait up to ``timeout_ms`` for anything; handle every message that came; raise on a death."""
        events = dict(self._poller.poll(max(0, int(timeout_ms))))
        if self._router in events:
            while True:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames)
        if self._monitor is not None and self._monitor in events:
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)
                raw = event.get("endpoint", b"")
                endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
                if endpoint.startswith("tcp://") and self._remote_lost is None:
                    self._remote_lost = f"a remote node's connection to {endpoint} was lost"
        self._check_liveness()

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 4:
            logger.warning("ignoring a malformed message of %d frames", len(frames))
            return
        identity, kind, seq_frame, payload = frames
        peer = wp.parse_identity(identity)
        if peer is None:
            logger.warning("ignoring a message from unknown peer %r", identity)
            return
        role, index = peer
        if kind == wp.JOIN and role == "node":
            self._answer_join(identity, index)
        elif kind == wp.HELLO and role == "rank":
            info = self._generic_decoder.decode(payload)
            self._ranks_info[index] = info
            logger.debug("worker rank %d up: pid %s on %s", index, info.get("pid"), info.get("host"))
        elif kind in (wp.OUTPUT, wp.RESULT) and role == "rank":
            replies = self._pending.get(wp.decode_seq(seq_frame))
            if replies is not None:
                replies[index] = payload
        elif kind == wp.FAILURE and role == "rank":
            request_kind, message = self._generic_decoder.decode(payload)
            self._failures.append((index, wp.decode_seq(seq_frame), request_kind, message))

    def _answer_join(self, identity: bytes, node_rank: int) -> None:
        error = None
        if not 0 < node_rank < self.topology.nnodes:
            error = f"node rank {node_rank} is not in [1, {self.topology.nnodes}) (SPARROW_NNODES on node 0)"
        elif node_rank in self._joined_nodes:
            error = f"node rank {node_rank} has already joined"
        if error is None:
            self._joined_nodes.add(node_rank)
            reply = {"config": self.config.model_dump_json(), "world_size": self.world_size,
                     "nnodes": self.topology.nnodes, "init_method": "env://"}
            logger.info("node %d joined", node_rank)
        else:
            logger.warning("refusing a node: %s", error)
            reply = {"error": error}
        try:
            self._router.send_multipart([identity, wp.CONFIG, wp.encode_seq(0), self._encoder.encode(reply)])
        except zmq.ZMQError:
            logger.warning("node %d left before its configuration was sent", node_rank)

    # -- failures ---------------------------------------------------------------------------
    def _check_liveness(self) -> None:
        for rank, proc in self._procs.items():
            if proc.exitcode is not None:
                self._die(f"worker rank {rank} (pid {proc.pid}) {_describe_exit(proc.exitcode)}")
        if self._remote_lost is not None:
            self._die(self._remote_lost)

    def _raise_failures(self, fatal: bool, what: str, seq: int | None = None) -> None:
        """Raise for a failure report: any step's (fatal) or this call's (seq)."""
        step_kinds = (wp.EXECUTE.decode(), wp.HELLO.decode())
        # A late failure of an RPC whose caller already gave up concerns nobody any more.
        self._failures = [f for f in self._failures if f[2] in step_kinds or f[1] == seq]
        for rank, failed_seq, request_kind, message in self._failures:
            is_step = request_kind in step_kinds
            # Give a peer's death a moment to surface: it is the cause, this report its echo.
            deadline = time.monotonic() + (_DEATH_GRACE_S if is_step or fatal else 0.0)
            while time.monotonic() < deadline and not any(p.exitcode is not None for p in self._procs.values()):
                time.sleep(0.05)
            summary = next((line for line in reversed(message.splitlines()) if line.strip()), "")
            text = (f"worker rank {rank} failed in {what if failed_seq == seq else 'a model step'}: {summary}\n"
                    f"{message}")
            dead = [f"worker rank {r} (pid {p.pid}) {_describe_exit(p.exitcode)}"
                    for r, p in self._procs.items() if p.exitcode is not None]
            if dead:
                text = "; ".join(dead) + "\n" + text
            self._failures.clear()
            if fatal or is_step:
                self._die(text)
            raise RuntimeError(text)

    def _die(self, reason: str) -> None:
        if self._dead_reason is None:
            logger.error("tensor-parallel executor failed: %s", reason)
            self._dead_reason = reason
        raise WorkerDiedError(self._dead_reason)

    # -- shutdown ---------------------------------------------------------------------------
    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the ranks this process started."""
        return {rank: proc.pid for rank, proc in self._procs.items()}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            for rank in range(self.world_size):
                try:
                    self._router.send_multipart([wp.rank_identity(rank), wp.SHUTDOWN, wp.encode_seq(0), b""],
                                                flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # gone already
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for rank, proc in self._procs.items():
            if rank not in self._ranks_info:
                proc.terminate()  # still starting: it would read no SHUTDOWN for a while
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs.values():
            if proc.is_alive():
                logger.warning("worker pid %d did not exit; terminating it", proc.pid)
                proc.terminate()
                proc.join(_SHUTDOWN_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join(_SHUTDOWN_GRACE_S)
        for proc in self._procs.values():
            proc.close()
        if self._started:
            if self._monitor is not None:
                self._router.disable_monitor()
                self._monitor.close(linger=0)
            # Remote ranks get their SHUTDOWN before the socket goes.
            self._router.close(linger=1000 if self.topology.is_multi_node else 0)
            self._ctx.term()
            shutil.rmtree(self._tmpdir, ignore_errors=True)


class PendingStep:
    """A step sent to the ranks (a ``StepHandle``); ``result()`` waits for rank 0's output."""

    __slots__ = ("_executor", "_seq")

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor, self._seq = executor, seq

    def result(self) -> ModelRunnerOutput:
        return self._executor._step_result(self._seq)
