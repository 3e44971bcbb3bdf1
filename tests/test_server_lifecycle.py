"""`sparrow serve` over its lifetime: a busy port, help texts, a huge prompt that must not stall the
event loop, the engine core dying (the server exits non-zero) and SIGTERM (in-flight requests
drain within --shutdown-timeout, then open streams end with an error event and [DONE]).

Real server processes on 127.0.0.1, a small real model built locally, httpx and the openai client.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

MODEL_NAME = "tiny-lifecycle"
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
# Generous bounds for a busy machine: reaching one is a hang, not slowness.
START_TIMEOUT_S = 180
EXIT_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Live children of ``pid``, from /proc (no psutil)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            children.append(int(entry.name))
    return children


class ServerProcess:
    def __init__(self, model_dir: str, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "sparrow.entrypoints.cli", "serve", model_dir, "--port", str(self.port),
            "--served-model-name", MODEL_NAME, "--max-model-len", "2048", "--kv-cache-memory-bytes", str(16 << 20),
            "--disable-access-log", *extra,
        ]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy in time:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self) -> int:
        return self.proc.wait(EXIT_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from sparrow.tiny.model import build_model_dir

    return str(build_model_dir(tmp_path_factory.mktemp("lifecycle-model"), "qwen3", "test", seed=5))


@pytest.fixture
def start_server(model_dir, tmp_path):
    servers = []

    def start(*extra: str) -> ServerProcess:
        servers.append(ServerProcess(model_dir, tmp_path / f"server{len(servers)}.log", *extra))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


HUGE_BODY_BYTES = 20_000_000


@pytest.fixture(scope="module")
def _reused(model_dir, tmp_path_factory):
    holder: dict[str, ServerProcess] = {}
    yield holder
    if "server" in holder:
        holder["server"].stop()


@pytest.fixture
def reused_server(_reused, model_dir, tmp_path_factory) -> ServerProcess:
    """A server that tests leaving it serving pass on (each start costs seconds of CI): the next
    test gets it as it was left, or a new one once a test has ended it."""
    server = _reused.get("server")
    if server is None or server.proc.poll() is not None:
        if server is not None:
            server.stop()
        log_path = tmp_path_factory.mktemp("reused-server") / "server.log"
        server = _reused["server"] = ServerProcess(model_dir, log_path, "--max-request-body-bytes",
                                                   str(HUGE_BODY_BYTES))
    return server


def long_stream_body(max_tokens: int = 1500) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


async def read_events(response: httpx.Response, first_chunk: asyncio.Event | None = None,
                      on_event=None) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    events = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        events.append(line[len("data: "):])
        if on_event is not None:
            on_event(events[-1])
        if first_chunk is not None:
            first_chunk.set()
    return events


# -- the command line ---------------------------------------------------------------------------
def test_every_serve_flag_has_a_help_text_with_its_default():
    from sparrow.entrypoints.cli import build_parser

    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.__class__.__name__ == "_SubParsersAction")
    serve = subparsers.choices["serve"]
    server_group = next(group for group in serve._action_groups if group.title == "server")
    flags = {action.option_strings[0]: action.help for action in server_group._group_actions}
    assert "--shutdown-timeout" in flags
    for flag, help_text in flags.items():
        assert help_text and "(default: " in help_text, f"{flag}: {help_text!r}"
    positional = next(action for action in serve._actions if action.dest == "model_pos")
    assert "(default: " in positional.help
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--shutdown-timeout", bad])
    assert parser.parse_args(["serve", "--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5


def test_a_busy_port_is_a_one_line_error_before_the_model_loads(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "sparrow.entrypoints.cli", "serve", model_dir, "--port", str(port)],
            capture_output=True, text=True, timeout=120)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode != 0
    # One line: no traceback, and nothing from loading a model (which would log at INFO).
    assert len(output.splitlines()) == 1, output
    assert str(port) in output and "already in use" in output, output


# -- a huge prompt ------------------------------------------------------------------------------
def test_a_huge_prompt_stalls_neither_health_checks_nor_open_streams(reused_server):
    server = reused_server  # --max-request-body-bytes 20 MB, left serving
    huge_prompt = ("The quick brown fox jumps over the lazy dog. " * 70_000)[:3_000_000]

    async def main():
        # Every event in the order the client saw it: "upload done", "health", "chunk", "huge answered".
        events: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            first_chunk = asyncio.Event()

            async def stream() -> list[str]:
                async with client.stream("POST", "/v1/completions", json=long_stream_body(2000)) as response:
                    assert response.status_code == 200
                    return await read_events(response, first_chunk, lambda _: events.append("chunk"))

            async def body():
                payload = json.dumps({"model": MODEL_NAME, "prompt": huge_prompt, "max_tokens": 1}).encode()
                for start in range(0, len(payload), 1 << 20):
                    yield payload[start:start + (1 << 20)]
                # Only now is the whole body on its way: the server's part starts here.
                events.append("upload done")

            async def huge() -> httpx.Response:
                response = await client.post("/v1/completions", content=body(),
                                             headers={"content-type": "application/json"})
                events.append("huge answered")
                return response

            async def poll_health():
                while "huge answered" not in events:
                    assert (await client.get("/health")).status_code == 200
                    events.append("health")

            stream_task = asyncio.create_task(stream())
            await asyncio.wait_for(first_chunk.wait(), 60)
            huge_task = asyncio.create_task(huge())
            await asyncio.gather(poll_health(), huge_task)
            await stream_task
            return events, huge_task.result()

    events, response = asyncio.run(main())
    assert response.status_code == 400 and "error" in response.json(), response.text
    window = events[events.index("upload done"):events.index("huge answered")]
    # While the server tokenized millions of tokens, the event loop kept answering and streaming.
    # A loop blocked by the tokenizer answers at most a few health checks in this window (before
    # it starts tokenizing), and the stream's tokens of those seconds arrive merged in one chunk.
    assert window.count("health") >= 20, (window.count("health"), window.count("chunk"))
    assert window.count("chunk") >= 5, (window.count("health"), window.count("chunk"))


# -- the engine core dies ----------------------------------------------------------------------
def test_when_the_engine_core_dies_requests_fail_and_the_server_exits_nonzero(reused_server):
    server = reused_server  # the huge prompt's server (or a new one): this test ends it
    engines = child_pids(server.proc.pid)
    assert len(engines) == 1, f"expected one engine core process, found {engines}"

    async def stream_until_error(client: openai.AsyncOpenAI, started: asyncio.Event) -> BaseException | None:
        stream = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2000, stream=True,
                                                 extra_body={"ignore_eos": True})
        try:
            async for _ in stream:
                started.set()
        except openai.APIError as exc:
            return exc
        return None

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            started = [asyncio.Event() for _ in range(2)]
            tasks = [asyncio.create_task(stream_until_error(client, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            os.kill(engines[0], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), EXIT_TIMEOUT_S)

    results = asyncio.run(main())
    assert all(isinstance(result, openai.APIError) for result in results), results
    assert all("engine" in str(result) for result in results), results
    assert server.wait() == 1, server.log()
    log = server.log()
    assert "the engine core died" in log and "Traceback" not in log, log


# -- SIGTERM ------------------------------------------------------------------------------------
def test_sigterm_ends_open_streams_with_an_error_event_then_done(start_server):
    server = start_server()  # the default --shutdown-timeout, 0: end them at once

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            first_chunk = asyncio.Event()

            async def stream() -> list[str]:
                async with client.stream("POST", "/v1/completions", json=long_stream_body()) as response:
                    return await read_events(response, first_chunk)

            tasks = [asyncio.create_task(stream()) for _ in range(2)]
            await asyncio.wait_for(first_chunk.wait(), 60)
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(asyncio.gather(*tasks), EXIT_TIMEOUT_S)

    for events in asyncio.run(main()):
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"] and "--shutdown-timeout" in error["message"], error
        assert error["code"] == "shutting_down", error
        assert error["type"] and error["code"], error
        assert not any('"finish_reason":"length"' in event for event in events)
    assert server.wait() == 0, server.log()
    log = server.log()
    assert "Traceback" not in log, log
    assert log.count("unfinished request(s) with an error") == 1, log


def test_sigterm_refuses_new_requests_and_lets_in_flight_ones_finish(start_server):
    server = start_server("--shutdown-timeout", "300")

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            first_chunk = asyncio.Event()
            stream_done = asyncio.Event()

            async def stream() -> list[str]:
                try:
                    async with client.stream("POST", "/v1/completions", json=long_stream_body()) as response:
                        return await read_events(response, first_chunk)
                finally:
                    stream_done.set()

            task = asyncio.create_task(stream())
            await asyncio.wait_for(first_chunk.wait(), 60)
            server.proc.send_signal(signal.SIGTERM)
            refused_while_streaming = False
            # A fresh connection each time: the listener closes once the signal is handled.
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as other:
                while not stream_done.is_set():
                    try:
                        status = (await other.get("/health")).status_code
                    except httpx.TransportError:
                        status = None  # connection refused: nobody listens any more
                    if status != 200:
                        refused_while_streaming = not stream_done.is_set()
                        break
                    await asyncio.sleep(0.01)
            return refused_while_streaming, await asyncio.wait_for(task, EXIT_TIMEOUT_S)

    refused_while_streaming, events = asyncio.run(main())
    assert refused_while_streaming
    assert events[-1] == "[DONE]"
    assert not any('"error"' in event for event in events), events[-3:]
    assert '"finish_reason":"length"' in events[-2]
    text = "".join(choice["text"] for event in events[:-1] for choice in json.loads(event)["choices"])
    assert text
    assert server.wait() == 0, server.log()
    assert "Traceback" not in server.log()
