"""How ``sparrow serve`` starts and stops around uvicorn.

    start            bind the listening sockets (a busy port is a one-line error), then load the model
    SIGTERM/SIGINT   refuse new requests: the listener closes, open connections get 503
                     -> wait up to --shutdown-timeout s for the requests in flight (and the
                        background responses, which no HTTP request holds)
                     -> end the rest: an error event then [DONE] for a stream, 503 otherwise (one log line)
                     -> uvicorn shuts down; exit code 0. A second signal ends the wait at once,
                        a third exits without ending the streams.
    engine core dies in-flight requests fail (error event / 503) -> uvicorn shuts down; exit code 1,
                     so that a supervisor (systemd, Kubernetes) restarts the server, as vLLM does
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from sparrow.engine.async_llm import AsyncLLM
from sparrow.engine.exceptions import EngineShutdownError
from sparrow.entrypoints.openai.http_guards import route_path
from sparrow.entrypoints.openai.serving_engine import APIError

logger = logging.getLogger(__name__)

# vLLM's default: on SIGTERM, in-flight requests are ended at once.
DEFAULT_SHUTDOWN_TIMEOUT_S = 0.0
EXIT_ENGINE_DEAD = 1
# How long the requests ended by a shutdown or an engine death get to send their last bytes.
_FLUSH_TIMEOUT_S = 5.0
_POLL_S = 0.05


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down and accepts no new requests", "ServiceUnavailableError",
                    code="shutting_down")


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Bind (not yet listen on) ``host``:``port`` for every address the host resolves to, so that a
    busy port fails in a second, before the model loads. uvicorn listens on them once serving."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SystemExit(f"sparrow: error: cannot resolve --host {host!r}: {exc.strerror}") from None
    if port == 0:
        infos = infos[:1]  # each address would get a different free port
    sockets: list[socket.socket] = []
    try:
        for family, sock_type, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, sock_type, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        hint = "; another process is listening there (pick another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise SystemExit(f"sparrow: error: cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sockets


# The endpoints whose requests --enable-server-load-tracking counts (vLLM's: those that run the model).
_LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                         "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})


class RequestTracker:
    """ASGI middleware: counts the HTTP requests in flight (a stream until its last byte) and, once
    the server drains, answers every new request 503. With ``track_load``
    (--enable-server-load-tracking), ``server_load`` counts those of them that run the model, which
    ``GET /load`` reports as vLLM does (0 without it). ``background_work`` counts the work in flight
    that no HTTP request holds (the background responses), which a drain waits for too."""

    def __init__(self, app: ASGIApp, track_load: bool = False) -> None:
        self.app = app
        self.track_load = track_load
        self.in_flight = 0
        self.server_load = 0
        self.draining = False
        self.background_work: Callable[[], int] = lambda: 0

    @property
    def busy(self) -> int:
        """The requests in flight, and the background work."""
        return self.in_flight + self.background_work()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            from fastapi.responses import JSONResponse

            error = shutting_down_error()
            await JSONResponse(error.body(), status_code=error.status_code)(scope, receive, send)
            return
        load = int(self.track_load and scope["method"] == "POST" and route_path(scope) in _LOAD_PATHS)
        self.in_flight += 1
        self.server_load += load
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.server_load -= load

    async def wait_idle(self, timeout_s: float, give_up: asyncio.Event | None = None) -> bool:
        """True once no request (nor background work) is in flight; False if some still is after
        ``timeout_s`` (or once ``give_up`` is set)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.busy and loop.time() < deadline and not (give_up is not None and give_up.is_set()):
            await asyncio.sleep(_POLL_S)
        return not self.busy


class Server(uvicorn.Server):
    """uvicorn's server with Sparrow's shutdown: draining on a signal, and exiting with
    ``EXIT_ENGINE_DEAD`` when the engine core dies. ``exit_code`` is set once ``serve`` returns."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, tracker: RequestTracker,
                 shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.tracker = tracker
        self.shutdown_timeout_s = shutdown_timeout_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._signals = 0
        self._stop_waiting = asyncio.Event()

    async def serve_sockets(self, sockets: list[socket.socket]) -> int:
        """Serve until a signal or the engine's death stops the server; return the exit code."""
        self._loop = asyncio.get_running_loop()
        self._spawn(self._exit_when_engine_dies())
        try:
            await self.serve(sockets=sockets)
        finally:
            for task in self._tasks:
                task.cancel()
        return self.exit_code

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            # uvicorn announces only the sockets it binds itself; say where this one listens.
            logging.getLogger("uvicorn.error").info(
                "serving %s on %s://%s:%d (Ctrl+C to stop)", self.engine.served_model_name,
                "https" if self.config.ssl else "http", f"[{host}]" if ":" in host else host, port)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # Runs in the signal handler (main thread, between two bytecodes): only hand off to the loop.
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._loop is None or self._signals > 2:
            self.should_exit = self.force_exit = True
        elif self._signals == 2:
            self._loop.call_soon_threadsafe(self._stop_waiting.set)
        else:
            self.tracker.draining = True
            self._loop.call_soon_threadsafe(self._spawn, self._drain(signal.Signals(sig).name))

    async def _drain(self, signal_name: str) -> None:
        for listener in getattr(self, "servers", []):
            listener.close()  # refuse new connections now, not only once uvicorn shuts down
        in_flight = self.tracker.busy
        logger.info("%s: accepting no new requests; waiting up to %g s for %d in flight",
                    signal_name, self.shutdown_timeout_s, in_flight)
        if not await self.tracker.wait_idle(self.shutdown_timeout_s, give_up=self._stop_waiting):
            waited = ("a second signal" if self._stop_waiting.is_set()
                      else f"--shutdown-timeout {self.shutdown_timeout_s:g} s")
            ended = self.engine.fail_all(EngineShutdownError(
                f"the server is shutting down ({signal_name}) and the request was unfinished after {waited}"))
            # One line for all of them: the requests themselves end without a traceback.
            logger.warning("%s: ended %d unfinished request(s) with an error after %s", signal_name, ended, waited)
            await self.tracker.wait_idle(_FLUSH_TIMEOUT_S)
        self.should_exit = True

    async def _exit_when_engine_dies(self) -> None:
        error = await self.engine.wait_until_dead()
        if self.tracker.draining:
            return  # our own shutdown ended the engine
        logger.error("the engine core died (%s); failing the requests in flight and exiting with code %d",
                     error, EXIT_ENGINE_DEAD)
        self.exit_code = EXIT_ENGINE_DEAD
        await self.tracker.wait_idle(_FLUSH_TIMEOUT_S)
        self.should_exit = True
