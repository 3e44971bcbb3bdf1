"""Grammar compiles in a child process, so that one that runs too long can be stopped.

xgrammar compiles in native code that no Python thread can interrupt, and a small grammar can take
minutes: ``(a|b)*`` written 2,000 times (12 KB) keeps a core busy for about two minutes, and a
grammar that slow to compile is also slow to apply (tens to hundreds of milliseconds per token
mask, on the step loop). In a thread, a timeout could fail the request but not give the core
back. Here each compile runs in a child process the engine core kills when its time is up.

The child is this file, run by path (``python compile_process.py``): it imports nothing but the
standard library and xgrammar, so it starts the same however Sparrow was installed. It receives
the engine's ``TokenizerInfo`` once, then grammars (``Grammar.serialize_json``), and answers each
with the compiled grammar (``CompiledGrammar.serialize_json``) and the time one token mask took at
the grammar's start (the manager refuses grammars over ``structured_outputs_mask_budget_ms``).

Messages on the pipes: an 8-byte header (two big-endian uint32: the JSON head's length and the
body's length), the head (a small JSON object) and the body (UTF-8 text).
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import time
from typing import Any, BinaryIO

_HEADER = struct.Struct(">II")
# Start-up imports xgrammar (which imports torch) and builds the compiler: a few seconds, more on
# a loaded machine. Not counted against the compile timeout.
_START_TIMEOUT_S = 120.0


class CompileTimeout(Exception):
    """The child did not answer within the compile timeout; it has been killed."""


class CompileWorkerError(RuntimeError):
    """The child failed outside a compile (it exited, or answered garbage); it has been killed."""


def _encode(head: dict[str, Any], body: str = "") -> bytes:
    head_bytes = json.dumps(head).encode()
    body_bytes = body.encode()
    return _HEADER.pack(len(head_bytes), len(body_bytes)) + head_bytes + body_bytes


# -- the parent's side ------------------------------------------------------------------------
class CompileWorker:
    """One child process and the pipes to it. Not thread-safe: one compile at a time (the
    manager hands each worker to one pool thread at a time)."""

    def __init__(self) -> None:
        """Start the child; it imports xgrammar while the caller builds the tokenizer's description
        (the two take about a second each), and waits for :meth:`start`."""
        # torch loads in the child but computes nothing; the parent's pid lets the child follow it.
        env = dict(os.environ, OMP_NUM_THREADS="1", SPARROW_COMPILE_PARENT=str(os.getpid()))
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        self.started = False

    def start(self, tokenizer_info_json: str, max_threads: int) -> None:
        """Hand the child the tokenizer and wait until it can compile."""
        try:
            self._send({"max_threads": max_threads}, tokenizer_info_json)
            head, _ = self._receive(time.monotonic() + _START_TIMEOUT_S)
        except CompileTimeout:
            self.kill()
            raise CompileWorkerError(f"the grammar compile process did not start within {_START_TIMEOUT_S:g} s") \
                from None
        if not head.get("ready"):
            self.kill()
            raise CompileWorkerError(f"the grammar compile process failed to start: {head.get('error')}")
        self.started = True

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def compile(self, grammar_json: str, timeout: float) -> tuple[str, float]:
        """The compiled grammar's JSON and the seconds its first token mask took. Raises
        ValueError for a grammar xgrammar refuses, :class:`CompileTimeout` after ``timeout``
        seconds and :class:`CompileWorkerError` when the child fails (both kill the child)."""
        self._send({}, grammar_json)
        head, body = self._receive(time.monotonic() + timeout)
        if "error" in head:
            raise ValueError(head["error"])
        return body, float(head["fill_seconds"])

    def terminate(self) -> None:
        """Kill the child; safe from any thread (a thread reading from it then sees it exit)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def kill(self) -> None:
        """Kill the child and close the pipes: only from the thread using this worker."""
        self.terminate()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()

    def close(self) -> None:
        """End the child: EOF on its input ends an idle child; a busy one is killed. Only from
        the thread using this worker (or when no thread is)."""
        if self._proc.poll() is None and self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=1.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def _send(self, head: dict[str, Any], body: str) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(_encode(head, body))
            self._proc.stdin.flush()
        except OSError as exc:  # the child is gone
            self.kill()
            raise CompileWorkerError(f"the grammar compile process exited ({exc})") from None

    def _receive(self, deadline: float) -> tuple[dict[str, Any], str]:
        header = self._read_exact(_HEADER.size, deadline)
        head_len, body_len = _HEADER.unpack(header)
        head = json.loads(self._read_exact(head_len, deadline))
        return head, self._read_exact(body_len, deadline).decode()

    def _read_exact(self, count: int, deadline: float) -> bytes:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        chunks: list[bytes] = []
        while count:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.kill()
                raise CompileTimeout
            chunk = os.read(fd, min(count, 1 << 20))
            if not chunk:
                status = self._proc.wait()
                self.kill()
                raise CompileWorkerError(f"the grammar compile process exited (status {status})")
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)


# -- the child's side -------------------------------------------------------------------------
def _read_message(stream: BinaryIO) -> tuple[dict[str, Any], str] | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the parent closed the pipe (or died): time to go
    head_len, body_len = _HEADER.unpack(header)
    head = json.loads(stream.read(head_len))
    return head, stream.read(body_len).decode()


def _die_with_parent() -> None:
    """Linux: be killed when the parent (its thread that started this process) goes, even in the
    middle of a compile; an idle child also ends at EOF on its input."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != os.environ.get("SPARROW_COMPILE_PARENT", str(os.getppid())):
        os._exit(0)  # the parent went before the line above


def _serve() -> None:
    _die_with_parent()
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer

    def reply(head: dict[str, Any], body: str = "") -> None:
        out.write(_encode(head, body))
        out.flush()

    try:
        import xgrammar
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the request
        xgrammar = None
        failure = f"{type(exc).__name__}: {exc}"
    hello = _read_message(stdin)
    if hello is None:
        return
    if xgrammar is None:
        reply({"error": failure})
        return
    try:
        info = xgrammar.TokenizerInfo.deserialize_json(hello[1])
        compiler = xgrammar.GrammarCompiler(info, max_threads=int(hello[0]["max_threads"]))
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which logs and fails requests
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return
    reply({"ready": True})
    while (message := _read_message(stdin)) is not None:
        try:
            compiled = compiler.compile_grammar(xgrammar.Grammar.deserialize_json(message[1]))
            matcher = xgrammar.GrammarMatcher(compiled)
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            fill_seconds = time.perf_counter() - started
            body = compiled.serialize_json()
        except (RuntimeError, ValueError) as exc:
            reply({"error": str(exc)})
            continue
        reply({"fill_seconds": fill_seconds}, body)


if __name__ == "__main__":
    _serve()
