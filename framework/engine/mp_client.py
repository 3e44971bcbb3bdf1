"""Clients that run the engine core in its own process (P1) and talk to it over ZMQ.

``SyncMPClient`` is what ``LLM`` uses by default; ``AsyncMPClient`` is what ``AsyncLLM`` uses.
Both start ``run_engine_core`` in a fresh interpreter (``sparrow.engine.launch``: the caller's
``__main__`` is never imported again), bind two ``ipc://`` sockets in a private temp dir (input:
frontend PUSH -> core PULL; output: core PUSH -> frontend PULL), wait for the core's READY
handshake, and then read outputs on a background thread. The process, its sockets and that thread
are an ``EngineProcess`` (``sparrow.engine.engine_process``).

Lifetime: the ``EngineProcess`` holds no reference to the client, so a client (and the ``LLM``
around it) that is dropped is collected, and a ``weakref.finalize`` on the client shuts the engine
down then; the same finalizer runs at interpreter exit and on ``shutdown()``, whichever comes first.

Set ``SPARROW_ENABLE_MULTIPROCESSING=0`` to make ``make_client`` return an ``InprocClient``
(the engine core inside the caller's process: for debugging with pdb or a profiler).
``SPARROW_ENGINE_READY_TIMEOUT_S`` (default 600) bounds the wait for the core to start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import weakref
from typing import Any, Callable

from sparrow.config import EngineConfig
from sparrow.engine.core_client import InprocClient
from sparrow.engine.core_proc import load_executor_factory
from sparrow.engine.engine_process import EngineProcess
from sparrow.engine.exceptions import EngineDeadError
from sparrow.engine.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

ENV_MULTIPROCESSING = "SPARROW_ENABLE_MULTIPROCESSING"


def multiprocessing_enabled() -> bool:
    return os.environ.get(ENV_MULTIPROCESSING, "1").strip().lower() not in ("0", "false", "no", "off")


def make_client(config: EngineConfig, multiprocess: bool | None = None, *,
                executor_factory: str | None = None) -> InprocClient | SyncMPClient:
    """The synchronous engine-core client ``LLM`` uses.

    ``multiprocess`` None follows ``SPARROW_ENABLE_MULTIPROCESSING`` (on unless it is "0").
    ``executor_factory`` ("package.module:callable") replaces the configured executor; tests use
    it to run a fake model in the engine process.
    """
    if multiprocess is None:
        multiprocess = multiprocessing_enabled()
    if not multiprocess:
        executor = load_executor_factory(executor_factory) if executor_factory else None
        return InprocClient(config, executor)
    return SyncMPClient(config, executor_factory=executor_factory)


class MPClient:
    """A client of one engine process. The process lives until ``shutdown()``, until the client is
    garbage-collected, or until the interpreter exits, whichever comes first."""

    def __init__(self, config: EngineConfig, executor_factory: str | None = None) -> None:
        self._engine = EngineProcess(config, executor_factory, self._make_deliver())
        # Created after the process started, so that at exit (finalizers run newest first) the
        # clean shutdown comes before the launcher's last-resort termination of the child.
        self._finalizer = weakref.finalize(self, self._engine.shutdown)
        self.kv_cache_info = self._engine.kv_cache_info

    def _make_deliver(self) -> Callable[[EngineCoreOutputs | EngineDeadError], None]:
        """The reader thread's way to hand over outputs; it must not refer to ``self``."""
        raise NotImplementedError

    @property
    def proc(self) -> Any:
        """The engine core's process (``sparrow.engine.launch.ChildProcess``)."""
        return self._engine.proc

    @property
    def _tmpdir(self) -> str:
        return self._engine.tmpdir

    @property
    def is_dead(self) -> bool:
        return self._engine.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._engine.dead_error

    def shutdown(self) -> None:
        """Stop the engine process and release everything; idempotent."""
        self._finalizer()


class SyncMPClient(MPClient):
    """Blocking client with the same methods as ``InprocClient``."""

    def _make_deliver(self) -> Callable[[EngineCoreOutputs | EngineDeadError], None]:
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        return self._outputs.put

    def add_request(self, request: EngineCoreRequest) -> None:
        self._engine.send_add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._engine.send_abort(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """The next outputs of the core; raises EngineDeadError once the core is dead."""
        item = self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put(item)  # every later (or concurrent) caller fails too
            raise item
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._engine.start_utility_call(method, args).result()


class _LoopOutputs:
    """The async client's output queue: bound to the event loop of the client's first async call;
    what arrives before that waits in a list."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._early: list[EngineCoreOutputs | EngineDeadError] = []
        self._lock = threading.Lock()

    def bind(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.loop is None:
                self.loop, self.queue = loop, asyncio.Queue()
                for item in self._early:
                    self.queue.put_nowait(item)
                self._early.clear()
            elif self.loop is not loop:
                raise RuntimeError("AsyncMPClient is used from a different event loop than the one it is bound to")
        assert self.queue is not None
        return self.queue

    def deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        with self._lock:
            if self.loop is None:
                self._early.append(item)
                return
            loop, outputs = self.loop, self.queue
        assert outputs is not None
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to read outputs


class AsyncMPClient(MPClient):
    """asyncio client. It binds to the event loop of its first async call."""

    def _make_deliver(self) -> Callable[[EngineCoreOutputs | EngineDeadError], None]:
        self._outputs = _LoopOutputs()
        return self._outputs.deliver

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._outputs.bind()
        self._engine.send_add(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._engine.send_abort(request_ids)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Sending never waits on the engine, so an abort works from sync code (a closing generator)."""
        self._engine.send_abort(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = self._outputs.bind()
        item = await outputs.get()
        if isinstance(item, EngineDeadError):
            outputs.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._outputs.bind()
        return await asyncio.wrap_future(self._engine.start_utility_call(method, args))
