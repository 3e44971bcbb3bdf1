"""One tensor-parallel rank in its own process, and the wire protocol it speaks with the executor.

The executor binds one ZMQ ROUTER socket (``ipc://`` on its machine, plus ``tcp://`` for other
machines); every rank connects a DEALER whose identity is ``rank-<n>``. Frames::

    executor -> rank   [kind, seq, payload]      EXECUTE  payload = SchedulerOutput (msgpack)
                                                 RPC      payload = [method, [args], {kwargs}]
                                                 SHUTDOWN payload = b""
    rank -> executor   [kind, seq, payload]      HELLO    payload = {rank, pid, host} (once)
                                                 OUTPUT   payload = ModelRunnerOutput (rank 0 only)
                                                 RESULT   payload = the RPC's return value
                                                 FAILURE  payload = [request kind, traceback]

``seq`` (8 bytes, big-endian) numbers the executor's messages, so a late reply to an abandoned
call is never mistaken for the answer to the current one. A node launcher (``remote_worker``)
connects as ``node-<n>`` and sends JOIN; the executor answers CONFIG with what its ranks need.
Only rank 0 answers EXECUTE: every rank runs the same step and rank 0 holds the result; the
others speak only when they fail.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from sparrow.config import EngineConfig
from sparrow.engine.launch import ChildProcess, start_process
from sparrow.executor import rpc
from sparrow.executor.topology import core_share
from sparrow.executor.worker_extension import worker_class

logger = logging.getLogger(__name__)

EXECUTE, RPC, SHUTDOWN, CONFIG = b"E", b"R", b"S", b"C"
HELLO, OUTPUT, RESULT, FAILURE, JOIN = b"H", b"O", b"r", b"F", b"J"

# ZMTP heartbeats run in ZMQ's I/O thread, so a machine that vanishes without closing its
# connections (power loss, partition) is noticed even while the application threads compute.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
# After its parent dies, how long a rank may take to exit by SIGTERM before it exits hard.
_PARENT_DEATH_GRACE_S = 3.0
ENV_CPU_THREADS = "SPARROW_CPU_THREADS"


def rank_identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def node_identity(node_rank: int) -> bytes:
    return f"node-{node_rank}".encode()


def parse_identity(identity: bytes) -> tuple[str, int] | None:
    """``(role, index)`` of a peer identity (``("rank", 3)``), or None for a foreign one."""
    role, _, index = identity.decode(errors="replace").partition("-")
    if role not in ("rank", "node") or not index.isdigit():
        return None
    return role, int(index)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big")


def set_heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """Everything a rank process needs; pickled into the child process."""

    config: EngineConfig
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    distributed_init_method: str | None
    endpoint: str  # the executor's ROUTER socket


def spawn_worker(spec: WorkerSpec) -> ChildProcess:
    """Start ``spec``'s rank in a fresh interpreter (``sparrow.engine.launch``: the user's main
    module is never imported again).

    The rank watches its death pipe: the OS closes the write end when the caller's process dies,
    however it dies (SIGKILL included), and the rank exits instead of lingering. Closing the
    returned process (``close()``) closes that end too.
    """
    return start_process(run_worker, name=f"SparrowWorker-{spec.rank}", args=(spec,))


def run_worker(spec: WorkerSpec, death_pipe: Connection | None = None) -> None:
    """Process entry point of one rank; exits 0 after SHUTDOWN, 1 when it could not start."""
    # Ctrl-C reaches every process of the terminal's group; the executor owns the shutdown, and
    # a rank dying of SIGINT first would be reported as a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _setup_logging(spec.rank)
    _watch_parent(death_pipe)
    _limit_cpu_threads(spec.local_world_size)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, rank_identity(spec.rank))
    sock.setsockopt(zmq.LINGER, 2000)
    set_heartbeats(sock)
    sock.connect(spec.endpoint)
    exit_code = 0
    try:
        proc = WorkerProc(spec, sock)
    except Exception:  # noqa: BLE001 - start-up failures go back to the executor with their traceback
        # The executor raises it with this traceback, up to the frontend: logged once, there.
        logger.debug("worker rank %d failed to start", spec.rank, exc_info=True)
        sock.send_multipart([FAILURE, encode_seq(0), msgspec.msgpack.encode(["H", traceback.format_exc()])])
        exit_code = 1
    else:
        try:
            proc.run()
        finally:
            proc.close()
    sock.close()
    ctx.term()
    # Skip the interpreter's teardown: unloading torch and friends takes seconds (more on a busy
    # machine) and a rank that has shut down cleanly has nothing left to release.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class WorkerProc:
    """The rank's loop: one message at a time, in order, from the executor."""

    # Methods answered by the process itself rather than the platform's worker.
    PROC_METHODS = ("process_info",)

    def __init__(self, spec: WorkerSpec, sock: zmq.Socket) -> None:
        from sparrow.executor.uniproc import execute_step
        from sparrow.platforms import resolve_platform
        from sparrow.plugins import get_plugin_manager

        self.spec = spec
        self.sock = sock
        platform = resolve_platform(spec.config.device.device)
        worker_cls = worker_class(platform.worker_cls, spec.config)
        self.worker = worker_cls(config=spec.config, platform=platform, rank=spec.rank, local_rank=spec.local_rank,
                                 world_size=spec.world_size, distributed_init_method=spec.distributed_init_method)
        # Overlapped scheduling: a step returns before its sampled tokens reach the host; rank 0
        # sends its output once the next step is launched, or when no next step is waiting (run).
        self._execute = execute_step(get_plugin_manager(), self.worker,
                                     defer=bool(spec.config.scheduler.async_scheduling))
        self.sock.send_multipart([HELLO, encode_seq(0), msgspec.msgpack.encode(self.process_info())])

    def process_info(self) -> dict[str, Any]:
        return {"rank": self.spec.rank, "local_rank": self.spec.local_rank, "pid": os.getpid(),
                "host": socket.gethostname()}

    def run(self) -> None:
        from sparrow.core.sched.output import SchedulerOutput
        from sparrow.engine import serial
        from sparrow.wire import ModelRunnerOutput

        so_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        # As in the engine core (core_proc.freeze_startup_objects): the model and the worker live
        # as long as the process, so keep full collections from walking them mid-step.
        gc.collect()
        gc.freeze()
        generic = msgspec.msgpack.Decoder()
        encoder = msgspec.msgpack.Encoder()
        waiting: tuple[bytes, Any] | None = None  # rank 0: a step's deferred output, not yet sent

        def send_waiting() -> None:
            nonlocal waiting
            if waiting is None:
                return
            seq, deferred = waiting
            waiting = None
            try:
                self.sock.send_multipart([OUTPUT, seq, encoder.encode(deferred.result())], copy=False)
            except Exception:  # noqa: BLE001 - reported like a failed step
                logger.exception("rank %d: execute_model failed", self.spec.rank)
                self.sock.send_multipart([FAILURE, seq, encoder.encode(["E", traceback.format_exc()])])

        while True:
            while waiting is not None:  # send it as soon as it is ready, unless a next step comes first
                if waiting[1].ready():
                    send_waiting()
                elif self.sock.poll(0):
                    break
            kind, seq, payload = self.sock.recv_multipart()
            if kind != EXECUTE:
                send_waiting()
            if kind == SHUTDOWN:
                logger.debug("rank %d: shutdown", self.spec.rank)
                return
            try:
                if kind == EXECUTE:
                    output = self.execute_model(so_decoder.decode(payload))
                    send_waiting()  # the previous step's, now that this one is launched
                    if self.spec.rank == 0:
                        if isinstance(output, ModelRunnerOutput):
                            self.sock.send_multipart([OUTPUT, seq, encoder.encode(output)], copy=False)
                        else:
                            waiting = (seq, output)
                elif kind == RPC:
                    method, args, kwargs = generic.decode(payload)
                    result = serial.encode_result(self.call(method, args, kwargs))
                    self.sock.send_multipart([RESULT, seq, encoder.encode(result)], copy=False)
                else:
                    raise ValueError(f"unknown message kind {kind!r}")
            except Exception:  # noqa: BLE001 - every failure is reported; the executor decides
                logger.exception("rank %d: %s failed", self.spec.rank, "execute_model" if kind == EXECUTE else "rpc")
                self.sock.send_multipart([FAILURE, seq, encoder.encode([kind.decode(), traceback.format_exc()])])

    def execute_model(self, scheduler_output: Any) -> Any:
        output = self._execute(scheduler_output)
        if output is None:
            raise RuntimeError(f"no plugin executed the model for platform {self.worker.platform.name!r}")
        return output

    def call(self, method: str | bytes, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """``worker.method(*args, **kwargs)``, or a pickled function of the worker (sparrow.executor.rpc);
        a non-callable attribute is returned as is."""
        if isinstance(method, bytes):
            return rpc.run_function(self.worker, method, args, kwargs)
        value = rpc.resolve(self if method in self.PROC_METHODS else self.worker, method)
        return value(*args, **kwargs) if callable(value) else value

    def close(self) -> None:
        try:
            self.worker.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            logger.exception("rank %d: worker shutdown failed", self.spec.rank)


def _setup_logging(rank: int) -> None:
    from sparrow.utils.process_logging import setup_process_logging

    setup_process_logging(f"Worker rank={rank} pid={os.getpid()}")


def _limit_cpu_threads(local_world_size: int) -> None:
    """Share the machine's cores between its ranks unless ``SPARROW_CPU_THREADS`` says otherwise:
    ranks each using every core would oversubscribe the CPU and slow every collective down.

    Through ``OMP_NUM_THREADS`` while torch is not loaded yet: importing torch here would load
    OpenMP before the platform's worker module chooses how its threads wait (``sparrow_cpu.threads``:
    libgomp reads that once, at load). A platform worker may set its own count later.
    """
    if os.environ.get(ENV_CPU_THREADS):
        return
    count = core_share(local_world_size)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(count)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(count))


def _watch_parent(death_pipe: Connection | None) -> None:
    if death_pipe is None:
        return

    def watch() -> None:
        # Readable (EOF) exactly when the parent's process is gone; the parent never writes.
        while not death_pipe.poll(1.0):
            pass
        logger.warning("parent process is gone; worker exiting")
        # SIGTERM's default action ends the process at once, even inside a collective; _exit
        # covers a handler someone installed that does not exit.
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_PARENT_DEATH_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="WorkerParentWatch", daemon=True).start()
