"""The engine-core process seen from the frontend: the process, its two ZMQ sockets, the reader
thread and the pending utility calls.

``MPClient`` (``sparrow.engine.mp_client``) owns one ``EngineProcess``. The process object holds
no reference to its client, so a client that is dropped is collected and its ``weakref.finalize``
shuts the process down (see mp_client's docstring for the lifetime rules).

    reader thread:  output socket + the process sentinel
        EngineCoreOutputs            -> ``deliver`` (the client's queue)
        utility_output               -> the future of that call id
        engine_dead_message / exit   -> EngineDeadError to every pending and later caller

``SPARROW_ENGINE_READY_TIMEOUT_S`` (default 600) bounds the wait for the core to start.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from sparrow.config import EngineConfig
from sparrow.engine import serial
from sparrow.engine.core_proc import run_engine_core
from sparrow.engine.exceptions import EngineDeadError, EngineStartupError
from sparrow.engine.launch import start_process
from sparrow.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

logger = logging.getLogger(__name__)

ENV_READY_TIMEOUT = "SPARROW_ENGINE_READY_TIMEOUT_S"
# The reader thread wakes this often to notice a shutdown; outputs are read as they arrive.
_READER_POLL_MS = 100
# After the engine process exits, how long to wait for its last messages still in flight.
_DRAIN_AFTER_EXIT_MS = 200
_TERMINATE_TIMEOUT_S = 5.0


class EngineProcess:
    """The engine process, its sockets, the reader thread and the pending calls.

    Everything the reader thread and the client's finalizer touch lives here and nothing here
    refers to the client, so the client can be collected while the thread runs. ``deliver`` hands
    an output (or the death notice) to the client's queue; it is called on the reader thread.
    """

    def __init__(self, config: EngineConfig, executor_factory: str | None,
                 deliver: Callable[[EngineCoreOutputs | EngineDeadError], None]) -> None:
        self._deliver = deliver
        self._closed = False
        self._dead_error: EngineDeadError | None = None
        # Guards _pending_calls, _dead_error and _closed. Reentrant: a collection that runs a
        # finalizer (and so shutdown) can start on any thread, the reader's included.
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()  # the input socket is used by any caller's thread
        self._pending_calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._stop_reader = threading.Event()
        self._reader: threading.Thread | None = None
        self._encoder = serial.make_encoder()

        self.tmpdir = tempfile.mkdtemp(prefix="sparrow-engine-")
        input_path = f"ipc://{self.tmpdir}/input.sock"
        output_path = f"ipc://{self.tmpdir}/output.sock"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_path)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(output_path)

        # The core watches its death pipe: the OS closes our end when this process dies, however
        # it dies, and the core shuts itself down.
        try:
            self.proc = start_process(
                run_engine_core, name="EngineCore",
                kwargs=dict(config=config, input_path=input_path, output_path=output_path,
                            parent_pid=os.getpid(), executor_factory=executor_factory))
        except BaseException:  # e.g. a configuration that cannot be pickled: nothing was started
            self._ctx.destroy(linger=0)
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            raise
        try:
            self.kv_cache_info = self._wait_for_ready()
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._read_outputs, name="EngineCoreClientReader", daemon=True)
        self._reader.start()

    # -- start-up ---------------------------------------------------------------------------
    def _wait_for_ready(self) -> dict[str, int]:
        timeout_s = float(os.environ.get(ENV_READY_TIMEOUT, "600"))
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        remaining_ms = timeout_s * 1000
        while remaining_ms > 0:
            events = dict(poller.poll(min(remaining_ms, 1000)))
            remaining_ms -= 1000
            if self._output in events:
                handshake = serial.handshake_decoder().decode(self._output.recv())
                if handshake.status != "READY":
                    self.proc.join(_TERMINATE_TIMEOUT_S)  # it exits by itself after saying so
                    raise EngineStartupError(f"the engine core failed to start:\n{handshake.error}")
                logger.info("engine core pid %d ready: %d KV blocks of %d tokens",
                            self.proc.pid, handshake.num_blocks, handshake.block_size)
                return {"num_blocks": handshake.num_blocks, "block_size": handshake.block_size,
                        "max_model_len": handshake.max_model_len}
            if self.proc.sentinel in events:
                self.proc.join(1.0)
                raise EngineStartupError(
                    f"the engine core process exited with code {self.proc.exitcode} before it was ready; "
                    "see its log above")
        raise EngineStartupError(f"the engine core was not ready after {timeout_s:.0f}s ({ENV_READY_TIMEOUT})")

    # -- sending ----------------------------------------------------------------------------
    def send(self, request_type: EngineCoreRequestType, payload: bytes) -> None:
        frames = (request_type.value, payload)
        with self._send_lock:
            while True:
                self.raise_if_dead()
                try:
                    self._input.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    # Only before the core's input socket has connected (a few ms after READY)
                    # or when it is gone: wait, but never past the core's death.
                    if not self.proc.is_alive():
                        raise self._dead_error or EngineDeadError() from None
                    self._input.poll(_READER_POLL_MS, zmq.POLLOUT)

    def send_add(self, request: EngineCoreRequest) -> None:
        self.send(EngineCoreRequestType.ADD, self._encoder.encode(request))

    def send_abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.send(EngineCoreRequestType.ABORT, self._encoder.encode(list(request_ids)))

    def start_utility_call(self, method: str, args: tuple[Any, ...]) -> Future:
        future: Future = Future()
        call_id = next(self._call_ids)
        with self._lock:
            self.raise_if_dead()
            self._pending_calls[call_id] = future
        try:
            self.send(EngineCoreRequestType.UTILITY, self._encoder.encode([call_id, method, list(args)]))
        except BaseException:
            with self._lock:
                self._pending_calls.pop(call_id, None)
            raise
        return future

    # -- receiving (reader thread) ----------------------------------------------------------
    def _read_outputs(self) -> None:
        decoder = serial.outputs_decoder()
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        try:
            while not self._stop_reader.is_set():
                events = dict(poller.poll(_READER_POLL_MS))
                if self._output in events:
                    self._handle_outputs(decoder.decode(self._output.recv(copy=False).buffer))
                elif self.proc.sentinel in events:
                    # Read what the core sent before it exited, then declare it dead.
                    while self._output.poll(_DRAIN_AFTER_EXIT_MS):
                        self._handle_outputs(decoder.decode(self._output.recv(copy=False).buffer))
                    self.proc.join(1.0)
                    self._mark_dead(f"the engine core process exited unexpectedly (exit code {self.proc.exitcode})")
                    return
        except Exception as exc:  # noqa: BLE001 - a reader that stops must not leave callers waiting
            if not self._closed:  # a shutdown on this very thread closed the socket under it
                logger.exception("engine core client reader failed")
            self._mark_dead(f"the engine core client's reader failed: {exc!r}")
        finally:
            self._output.close(linger=0)

    def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.utility_output is not None:
            result = outputs.utility_output
            with self._lock:
                future = self._pending_calls.pop(result.call_id, None)
            if future is not None:
                if result.failure_message is not None:
                    # A timeout (collective_rpc's) stays a TimeoutError, and a refused argument a
                    # ValueError, as they are in one process.
                    error_cls = {"TimeoutError": TimeoutError, "ValueError": ValueError}.get(
                        result.failure_message.partition(":")[0], RuntimeError)
                    future.set_exception(
                        error_cls(f"utility call failed in the engine core: {result.failure_message}"))
                else:
                    try:
                        future.set_result(serial.decode_result(result.result))
                    except Exception as exc:  # noqa: BLE001 - a bad result fails its call only
                        future.set_exception(exc)
        if outputs.outputs or outputs.scheduler_stats is not None:
            self._deliver(outputs)
        if outputs.engine_dead_message is not None:
            self._mark_dead(outputs.engine_dead_message)

    def _mark_dead(self, message: str) -> None:
        with self._lock:
            if self._dead_error is not None:
                return
            if self._closed:
                message = "the engine was shut down"
            else:
                logger.error("engine core is dead: %s", message)
            self._dead_error = EngineDeadError(message)
            pending, self._pending_calls = self._pending_calls, {}
        for future in pending.values():
            future.set_exception(self._dead_error)
        self._deliver(self._dead_error)

    def raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine process (SIGTERM, then SIGKILL after a grace period) and clean up."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(_TERMINATE_TIMEOUT_S)
            if self.proc.is_alive():
                logger.warning("engine core pid %d ignored SIGTERM; killing it", self.proc.pid)
                self.proc.kill()
                self.proc.join(_TERMINATE_TIMEOUT_S)
        self._stop_reader.set()
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(_TERMINATE_TIMEOUT_S)
        else:
            self._output.close(linger=0)
        self._mark_dead("the engine was shut down")
        with self._send_lock:
            self._input.close(linger=0)
        self.proc.close()
        self._ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
