"""Trace every engine step as a JSON line in ``$SPARROW_TRACE_FILE``.

Both hooks are observed with ``wrapper=True``: the wrapper runs around the implementations that
decide (the kernel's defaults, which run the scheduler and the worker, or a plugin's replacement),
takes their result and returns it unchanged. A wrapper puts the hook back on the engine's hot
path: with none, the engine calls the scheduler and the worker directly.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from sparrow.hookspecs import hookimpl

# The hook-contract versions this plugin supports; the entry point names ``tracer`` below, and
# the loader reads the declaration from the module that defines it.
SPARROW_CONTRACT = ">=1.0,<2"
TRACE_FILE_ENV = "SPARROW_TRACE_FILE"


class StepTracer:
    """One per process. Schedule and execute run in that order in one engine step; the schedule
    wrapper leaves its timing here for the execute wrapper, which writes the step's line."""

    def __init__(self) -> None:
        self._file: IO[str] | None = None
        self._pid: int | None = None  # the process that opened _file
        self._step = 0
        self._schedule_s: float | None = None

    # -- hooks ------------------------------------------------------------------------------
    @hookimpl(wrapper=True)
    def sparrow_schedule(self, scheduler: Any):
        started = time.perf_counter()
        output = yield
        if self._trace_path() is None or output is None:
            return output
        self._schedule_s = time.perf_counter() - started
        if output.total_num_scheduled_tokens == 0:
            # The engine core runs no model for an empty step, so no execute wrapper will write it.
            self._write(output.num_scheduled_tokens, 0, rank=None, forward_s=None)
        return output

    @hookimpl(wrapper=True)
    def sparrow_execute_model(self, worker: Any, scheduler_output: Any):
        started = time.perf_counter()
        output = yield
        if self._trace_path() is None:
            return output
        forward_s = time.perf_counter() - started
        self._write(scheduler_output.num_scheduled_tokens, scheduler_output.total_num_scheduled_tokens,
                    rank=getattr(worker, "rank", None), forward_s=forward_s)
        return output

    # -- the file ---------------------------------------------------------------------------
    @staticmethod
    def _trace_path() -> str | None:
        return os.environ.get(TRACE_FILE_ENV) or None

    def _write(self, num_scheduled_tokens: dict[str, int], total: int, rank: int | None,
               forward_s: float | None) -> None:
        record = {
            "step": self._step, "pid": os.getpid(), "rank": rank,
            "num_scheduled_tokens": dict(num_scheduled_tokens),  # request id -> new tokens
            "total_num_scheduled_tokens": total,
            "schedule_s": self._schedule_s, "forward_s": forward_s,
        }
        self._step += 1
        self._schedule_s = None
        stream = self._stream()
        stream.write(json.dumps(record) + "\n")
        # Flushed per line: engine processes end without notice (killed at shutdown), and a
        # trace that loses its last steps is no trace.
        stream.flush()

    def _stream(self) -> IO[str]:
        # Reopened in a forked child: it must not share the parent's buffer.
        if self._file is None or self._pid != os.getpid():
            path = self._trace_path()
            if path is None:
                raise RuntimeError(f"{TRACE_FILE_ENV} is not set")
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
            self._pid = os.getpid()
        return self._file


# The entry point names this object. A plugin instance is the one piece of per-process state the
# plugin needs (step counter, open file); pluggy registers it like a module.
tracer = StepTracer()
