"""Errors the frontend raises about the engine core process."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process died or reported a fatal error; no request can make progress.

    Every pending caller gets this error; the engine has to be built again.
    """

    def __init__(self, message: str = "the engine core process died; see its log for the cause") -> None:
        super().__init__(message)


class EngineShutdownError(EngineDeadError):
    """The server is shutting down (SIGTERM, Ctrl-C) and ended the request unfinished."""


class EngineStartupError(RuntimeError):
    """The engine core process failed while starting; the message carries its traceback."""
