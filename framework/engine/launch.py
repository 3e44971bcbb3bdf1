"""Starting Sparrow's own processes (engine cores, tensor-parallel ranks) without touching ``__main__``.

multiprocessing's ``spawn`` makes the child import the parent's main module again (to find
functions defined there), so a script without an ``if __name__ == "__main__":`` guard builds a
second ``LLM`` inside its own engine process and dies with multiprocessing's bootstrapping error;
a script piped to stdin, a notebook kernel or an embedding application have main modules that
cannot be imported at all. ``fork`` avoids that but copies threads and device contexts (CUDA,
oneDNN, OpenMP pools) that are unsafe in a child. So every Sparrow child is a fresh interpreter:

    parent                                          child: python -c BOOTSTRAP <name> <payload fd>
    Popen(start_new_session, stdin=/dev/null) ---->  sys.path = the parent's (first pickle)
    payload pipe: sys.path, then a ChildSpec  ---->  import the target's module, call
                                                     target(*args, **kwargs, death_pipe=...)
    sentinel pipe read end  <----------------------  write end held until the child exits
    death pipe write end    ---------------------->  read end: EOF when the parent is gone

Nothing of the user's ``__main__`` is imported: the target is pickled by reference to a Sparrow
module, and its arguments must be picklable the same way (configs, specs, strings). The child's
``sys.path`` and working directory are the parent's, so whatever the parent could import (a test
module named by ``executor_factory``, say) the child can too; the interpreter's flags are passed on
as multiprocessing does.

The two pipes keep what multiprocessing gave us: ``ChildProcess.sentinel`` is a file descriptor
that becomes readable when the child exits (poll it with the child's sockets), and the death
pipe becomes readable in the child when the parent's process is gone, however it died.

The child starts a session of its own, so a terminal's Ctrl-C (SIGINT to the foreground process
group) reaches only the user's process: that process decides what an interrupt means (abort the
requests in flight, or exit and shut the engine down) and the engine is never killed behind its
back. A parent that exits without shutting a child down (a crash, SIGKILL) still takes it along
through the death pipe.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, BinaryIO, Callable

# Runs in the fresh interpreter before anything of Sparrow is importable: set sys.path from the
# first pickle (plain strings), then hand over to child_main. argv: [-c, <name>, <payload fd>].
_BOOTSTRAP = (
    "import os, pickle, sys; "
    "payload = os.fdopen(int(sys.argv[2]), 'rb'); "
    "sys.path[:] = pickle.load(payload); "
    "from sparrow.engine.launch import child_main; "
    "child_main(payload)"
)
# How long a child still running at the parent's exit gets between SIGTERM and SIGKILL.
_EXIT_GRACE_S = 5.0


@dataclass(slots=True)
class ChildSpec:
    """What the child runs; pickled into the payload pipe after ``sys.path``."""

    target: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    sentinel_fd: int = -1  # the child's end of the sentinel pipe: open until it exits
    death_pipe_fd: int | None = None  # the child's end of the death pipe, or None without one


class ChildProcess:
    """A started child, with the part of ``multiprocessing.Process`` Sparrow uses: ``pid``,
    ``name``, ``sentinel``, ``exitcode``, ``is_alive``, ``join``, ``terminate``, ``kill``.

    ``close()`` releases the pipes; closing the death pipe tells a still-running child to exit.
    A child still running when the parent's interpreter exits is terminated then (SIGTERM, then
    SIGKILL after a grace period), as multiprocessing does for daemonic children.
    """

    def __init__(self, popen: subprocess.Popen, name: str, sentinel: int, death_writer: int | None) -> None:
        self._popen = popen
        self.name = name
        self.sentinel = sentinel
        self._fds = [fd for fd in (sentinel, death_writer) if fd is not None]
        # The callback holds no reference to self: a dropped ChildProcess is still collected.
        self._finalizer = weakref.finalize(self, _release, popen, self._fds)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while running; the exit status, or -N when killed by signal N."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self._popen.poll() is None:
            try:
                os.kill(self._popen.pid, signum)
            except ProcessLookupError:
                pass  # exited between the poll and the signal; the next poll reaps it

    def close(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        return f"<ChildProcess {self.name} pid={self.pid} exitcode={self.exitcode}>"


def _release(popen: subprocess.Popen, fds: list[int]) -> None:
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def start_process(target: Callable[..., Any], *, name: str, args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None, death_pipe: bool = True) -> ChildProcess:
    """Run ``target(*args, **kwargs)`` in a fresh interpreter; returns once the child is started.

    ``target`` must be a module-level function of an importable module (not ``__main__``). With
    ``death_pipe`` the child also gets ``death_pipe=`` a read-only ``Connection`` that becomes
    readable (EOF) when this process is gone or closes the ChildProcess. ``name`` appears in the
    child's command line (``ps``) and its error messages.
    """
    module = getattr(target, "__module__", None)
    if module in (None, "__main__"):
        raise ValueError(f"start_process needs a function of an importable module, got {target!r}")
    executable = sys.executable
    if not executable:
        raise RuntimeError("cannot start a child process: sys.executable is empty in this interpreter")

    sentinel_reader, sentinel_writer = os.pipe()
    payload_reader, payload_writer = os.pipe()
    child_fds = [sentinel_writer, payload_reader]
    death_reader = death_writer = None
    if death_pipe:
        death_reader, death_writer = os.pipe()
        child_fds.append(death_reader)
    spec = ChildSpec(target=target, args=tuple(args), kwargs=dict(kwargs or {}),
                     sentinel_fd=sentinel_writer, death_pipe_fd=death_reader)
    try:
        # Pickled before the child exists: an argument that cannot cross fails here, in the caller.
        try:
            payload = pickle.dumps(list(sys.path)) + pickle.dumps(spec)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"cannot start {name}: its arguments must be picklable by reference to "
                            f"importable modules ({exc})") from exc
        command = [executable, *_interpreter_flags(), "-c", _BOOTSTRAP, name, str(payload_reader)]
        popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=child_fds, close_fds=True,
                                 start_new_session=True)
    except BaseException:
        for fd in (sentinel_reader, payload_writer, death_writer, *child_fds):
            if fd is not None:
                os.close(fd)
        raise
    for fd in child_fds:
        os.close(fd)
    try:
        with os.fdopen(payload_writer, "wb") as stream:
            stream.write(payload)
    except BrokenPipeError:
        pass  # the child died before reading; its exit code (the sentinel) tells the caller
    return ChildProcess(popen, name, sentinel_reader, death_writer)


def _interpreter_flags() -> list[str]:
    # -I, -E, -W and -X options, as multiprocessing passes them to its children.
    flags = getattr(subprocess, "_args_from_interpreter_flags", None)
    return list(flags()) if flags is not None else []


def child_main(payload: BinaryIO) -> None:
    """The child's side of ``start_process`` (called by the bootstrap, with sys.path set)."""
    spec: ChildSpec = pickle.load(payload)
    payload.close()
    # These are ours alone: a grandchild that inherited the sentinel would keep it open after
    # this process exits, and the parent would never see the exit.
    os.set_inheritable(spec.sentinel_fd, False)
    kwargs = dict(spec.kwargs)
    if spec.death_pipe_fd is not None:
        os.set_inheritable(spec.death_pipe_fd, False)
        kwargs["death_pipe"] = Connection(spec.death_pipe_fd, writable=False)
    spec.target(*spec.args, **kwargs)
