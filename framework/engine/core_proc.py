"""EngineCoreProc: the engine core in its own process (P1), fed and drained over ZMQ.

Three threads, so that msgpack and socket work overlaps with the model's forward pass:

    input thread   ZMQ PULL (frontend -> core) -> decode -> input_queue
    main thread    busy loop: drain input_queue, step() while there is work, block when idle
    output thread  output_queue -> encode -> ZMQ PUSH (core -> frontend)

The frontend binds both sockets on ``ipc://`` paths in a private temp dir and the core connects.
The core's first message on the output socket is the handshake (READY with its KV cache size, or
FAILED with the traceback of the start-up error); every later message is ``EngineCoreOutputs``.

The process stops cleanly on SIGTERM/SIGINT, and stops by itself when its parent dies (a death
pipe closes, or the parent pid changes), so a killed frontend never leaves an engine behind. An
exception in the busy loop is sent to the frontend as ``engine_dead_message`` before the process
exits, so pending callers fail at once instead of waiting on a silent socket.

No input can get that far: the input thread answers a malformed ADD (undecodable, wrong types or
values, unknown fields) with an error output for its request id, and drops other malformed
messages with a log line; a request the engine core rejects, or whose adding raises, fails alone
with an error output (``EngineCoreOutput.error_message``).
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from sparrow.config import EngineConfig
from sparrow.core.request import FinishReason
from sparrow.engine import serial
from sparrow.engine.core import EngineCore
from sparrow.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from sparrow.executor import Executor

logger = logging.getLogger(__name__)

# How long the input thread waits on its socket before checking whether it should stop.
_POLL_MS = 100
# How often an idle busy loop wakes to let a pending SIGTERM/SIGINT handler run.
_IDLE_WAKE_S = 0.1
# How long the output socket keeps unsent messages (the dead message above all) at close.
_OUTPUT_LINGER_MS = 2000
# How long the parent-death watcher waits for a clean shutdown before exiting hard.
_PARENT_DEATH_GRACE_S = 5.0

_STOP = object()  # output_queue sentinel: the output thread flushes and exits


class EngineCoreProc:
    """Owns an EngineCore and the three threads around it. Built and run inside P1."""

    def __init__(self, engine_core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket) -> None:
        self.engine_core = engine_core
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(input_socket,), name="EngineCoreInput", daemon=True)
        self._output_thread = threading.Thread(
            target=self._output_loop, args=(output_socket,), name="EngineCoreOutput", daemon=True)

    def start_io_threads(self) -> None:
        self._input_thread.start()
        self._output_thread.start()

    # -- the busy loop (main thread) ---------------------------------------------------------
    def run_busy_loop(self) -> None:
        while True:
            self._process_input_queue()
            # step() returns stats alone when there is no work, so an idle wake-up (an abort
            # that emptied the engine, a utility call) still refreshes the frontend's gauges.
            self.output_queue.put(self.engine_core.step())

    def _process_input_queue(self) -> None:
        if not self.engine_core.has_unfinished_requests():
            # Idle: sleep on the queue rather than spin. The wait is timed because a signal
            # handled by another thread (ZMQ's, torch's) does not wake a blocked main thread,
            # and Python runs signal handlers only in the main thread.
            while True:
                try:
                    request_type, payload = self.input_queue.get(timeout=_IDLE_WAKE_S)
                    break
                except queue.Empty:
                    continue
            self._handle_input(request_type, payload)
        while True:
            try:
                request_type, payload = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_input(request_type, payload)

    def _handle_input(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        # The input thread checked the payload's shape; a failure here is the request's own
        # (or an abort's) and must never reach the busy loop.
        if request_type is EngineCoreRequestType.ADD:
            self._add_request(payload)
        elif request_type is EngineCoreRequestType.ABORT:
            try:
                self.engine_core.abort_requests(payload)
            except Exception:  # noqa: BLE001 - a failed abort loses nothing but the abort
                logger.exception("aborting requests %s failed", payload)
        elif request_type is EngineCoreRequestType.UTILITY:
            call_id, method, args = payload
            self._call_utility(call_id, method, args)

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.engine_core.add_request(request)
        except ValueError as exc:
            # The request can never run (e.g. too long for the KV cache); it alone fails.
            logger.warning("request %s rejected: %s", request.request_id, exc)
            self.reject(request.request_id, str(exc), getattr(exc, "field", None))
        except Exception as exc:  # noqa: BLE001 - a request that breaks the input path fails alone
            logger.exception("request %s failed while being added", request.request_id)
            self.reject(request.request_id, f"the engine core failed to add the request: {type(exc).__name__}: {exc}")

    def reject(self, request_id: str, message: str, field: str | None = None) -> None:
        """Finish ``request_id`` with an error output (thread-safe: the input thread calls it too);
        ``field`` is the request field at fault (an InvalidArgumentError's), when known."""
        rejected = EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                                    error_message=message, error_field=field)
        self.output_queue.put(EngineCoreOutputs(outputs=[rejected]))

    def _call_utility(self, call_id: int, method: str, args: list[Any]) -> None:
        output = UtilityOutput(call_id=call_id)
        try:
            if method.startswith("_") or not callable(getattr(self.engine_core, method, None)):
                raise AttributeError(f"the engine core has no utility method {method!r}")
            result = serial.encode_result(getattr(self.engine_core, method)(*args))
            # Encoded here once so that a result msgpack cannot carry fails this call, not the
            # output thread.
            msgspec.msgpack.encode(result)
            output.result = result
        except Exception as exc:  # noqa: BLE001 - a failed utility call fails only its caller
            output.failure_message = f"{type(exc).__name__}: {exc}"
        deferred = self.engine_core._take_deferred_outputs()  # e.g. a pause's: they go out first
        if deferred is not None:
            self.output_queue.put(deferred)
        self.output_queue.put(EngineCoreOutputs(utility_output=output))

    # -- I/O threads ------------------------------------------------------------------------
    def _input_loop(self, socket: zmq.Socket) -> None:
        decoder, generic = serial.request_decoder(), serial.generic_decoder()
        try:
            while not self._stop.is_set():
                if not socket.poll(_POLL_MS):
                    continue
                frames = socket.recv_multipart(copy=False)
                try:
                    self._decode_input(frames, decoder, generic)
                except Exception:  # noqa: BLE001 - one bad message must not stop the input path
                    logger.exception("engine core dropped a malformed input message")
        except Exception:  # noqa: BLE001 - a broken socket is fatal, say so and stop the process
            logger.exception("engine core input thread failed")
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            socket.close(linger=0)

    def _decode_input(self, frames: list[Any], decoder: msgspec.msgpack.Decoder,
                      generic: msgspec.msgpack.Decoder) -> None:
        """Decode one message into the input queue. A malformed ADD is answered with an error
        output when its request id can be read, else logged and dropped, as are malformed ABORT
        and UTILITY messages; nothing malformed ever reaches the busy loop."""
        if len(frames) != 2:
            logger.warning("dropped an input message of %d frames (expected 2)", len(frames))
            return
        type_frame, payload = bytes(frames[0].buffer), frames[1].buffer
        try:
            request_type = EngineCoreRequestType(type_frame)
        except ValueError:
            logger.warning("dropped an input message of unknown type %r", type_frame[:8])
            return
        if request_type is EngineCoreRequestType.ADD:
            try:
                request = decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                request_id = serial.peek_request_id(payload)
                if request_id is None:
                    logger.warning("dropped an undecodable request without a readable request id: %s", exc)
                else:
                    message = f"invalid request: {serial.describe_invalid_request(exc)}"
                    logger.warning("request %s rejected: %s", request_id, message)
                    self.reject(request_id, message)
                return
            self.input_queue.put((request_type, request))
            return
        try:
            body = generic.decode(payload)
        except msgspec.DecodeError as exc:
            logger.warning("dropped an undecodable %s message: %s", request_type.name, exc)
            return
        if request_type is EngineCoreRequestType.ABORT:
            if not (isinstance(body, list) and all(isinstance(rid, str) for rid in body)):
                logger.warning("dropped an ABORT whose payload is not a list of request ids: %.200r", body)
                return
        elif not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], int)
                  and isinstance(body[1], str) and isinstance(body[2], list)):
            logger.warning("dropped a UTILITY call that is not [call_id, method, [args]]: %.200r", body)
            if isinstance(body, list) and body and isinstance(body[0], int) and not isinstance(body[0], bool):
                self.output_queue.put(EngineCoreOutputs(utility_output=UtilityOutput(
                    call_id=body[0], failure_message="malformed utility call: expected [call_id, method, [args]]")))
            return
        self.input_queue.put((request_type, body))

    def _output_loop(self, socket: zmq.Socket) -> None:
        encoder = serial.make_encoder()
        try:
            while True:
                outputs = self.output_queue.get()
                if outputs is _STOP:
                    return
                try:
                    frame = encoder.encode(outputs)
                except Exception:  # noqa: BLE001 - one unencodable message must not stop the outputs
                    logger.exception("engine core could not encode an output message; dropped")
                    continue
                socket.send(frame, copy=False)
        finally:
            socket.close(linger=_OUTPUT_LINGER_MS)

    def stop_io_threads(self) -> None:
        self._stop.set()
        self.output_queue.put(_STOP)
        for thread in (self._output_thread, self._input_thread):
            if thread.is_alive():
                thread.join(timeout=_OUTPUT_LINGER_MS / 1000 + 1)


def load_executor_factory(path: str) -> Executor:
    """Build an executor from ``"package.module:callable"`` (called with no arguments)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not attr:
        raise ValueError(f"executor_factory must look like 'package.module:callable', got {path!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory()


def run_engine_core(config: EngineConfig, input_path: str, output_path: str, parent_pid: int,
                    death_pipe: Connection | None = None, executor_factory: str | None = None) -> None:
    """Process entry point of P1 (a fresh interpreter, see sparrow.engine.launch); exits 0 on a clean stop."""
    _setup_logging()
    _install_signal_handlers()
    _watch_parent(parent_pid, death_pipe)
    zmq_ctx = zmq.Context()
    try:
        exit_code = _serve(config, input_path, output_path, zmq_ctx, executor_factory)
    finally:
        # destroy() closes any socket a signal left open mid-way; term() alone would wait on it
        # forever. The I/O threads are stopped by now.
        zmq_ctx.destroy(linger=_OUTPUT_LINGER_MS)
    sys.exit(exit_code)


def freeze_startup_objects() -> None:
    """Move everything start-up made (the model's modules, the plugins, pydantic models) out of
    the garbage collector's reach: they live as long as the process, and a full collection
    walking them in the middle of a step costs milliseconds. vLLM does the same after start-up."""
    gc.collect()
    gc.freeze()


def _serve(config: EngineConfig, input_path: str, output_path: str, zmq_ctx: zmq.Context,
           executor_factory: str | None) -> int:
    output_socket = zmq_ctx.socket(zmq.PUSH)
    output_socket.connect(output_path)
    try:
        executor = load_executor_factory(executor_factory) if executor_factory else None
        engine_core = EngineCore(config, executor)
    except SystemExit:
        output_socket.close(linger=0)
        return 0
    except Exception:  # noqa: BLE001 - every start-up failure goes back to the frontend
        # The frontend raises it with this traceback (EngineStartupError): logging it here as
        # well would show every start-up mistake twice.
        logger.debug("engine core failed to start", exc_info=True)
        failed = serial.HandshakeMessage(status="FAILED", error=traceback.format_exc())
        output_socket.send(serial.make_encoder().encode(failed))
        output_socket.close(linger=_OUTPUT_LINGER_MS)
        return 1

    # Sockets are made here and handed to the I/O threads, each then the only user of its own.
    input_socket = zmq_ctx.socket(zmq.PULL)
    input_socket.connect(input_path)
    proc = EngineCoreProc(engine_core, input_socket, output_socket)
    # The handshake goes through the output queue: once the output thread runs, it alone
    # touches the output socket.
    proc.output_queue.put(serial.HandshakeMessage(
        status="READY", num_blocks=engine_core.num_kv_blocks, block_size=engine_core.block_size,
        max_model_len=config.model.max_model_len or 0))
    exit_code = 0
    # Everything after the I/O threads start is inside the try: a SIGTERM that lands during
    # start-up (a frontend giving up right after READY) must still stop them before the context
    # closes their sockets, or the input thread fails on a closed socket.
    try:
        proc.start_io_threads()
        freeze_startup_objects()
        proc.run_busy_loop()
    except SystemExit:
        logger.info("engine core shutting down")
    except Exception as exc:  # noqa: BLE001 - tell the frontend, then die
        logger.exception("engine core busy loop failed")
        message = f"engine core died: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        proc.output_queue.put(EngineCoreOutputs(engine_dead_message=message))
        exit_code = 1
    finally:
        proc.stop_io_threads()
        try:
            engine_core.shutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.exception("engine core shutdown failed")
    return exit_code


def _setup_logging() -> None:
    from sparrow.utils.process_logging import setup_process_logging

    setup_process_logging(f"EngineCore pid={os.getpid()}")


def _install_signal_handlers() -> None:
    def request_shutdown(signum: int, frame: Any) -> None:
        # Raised in the main thread wherever it is (stepping or waiting on the input queue),
        # so the finally blocks close the sockets and the executor. Later signals are ignored
        # so that they cannot cut that clean-up short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, request_shutdown)
    signal.signal(signal.SIGINT, request_shutdown)


def _watch_parent(parent_pid: int, death_pipe: Connection | None) -> None:
    """Stop this process when the frontend dies, however it dies (SIGKILL included)."""

    def watch() -> None:
        while True:
            # The frontend holds the pipe's write end and never writes: it becomes readable
            # (EOF) exactly when the frontend's process is gone. The ppid check covers a
            # frontend that passed no pipe.
            if death_pipe is not None and death_pipe.poll(1.0):
                break
            if death_pipe is None:
                time.sleep(1.0)
            if os.getppid() != parent_pid:
                break
        logger.warning("frontend process %d is gone; engine core exiting", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_PARENT_DEATH_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="EngineCoreParentWatch", daemon=True).start()
