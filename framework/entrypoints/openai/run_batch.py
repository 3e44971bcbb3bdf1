"""``sparrow run-batch`` (vLLM's ``vllm run-batch``): an OpenAI batch file run offline.

Input: one JSON object per line, ``{"custom_id": str, "method": "POST", "url": str, "body":
{...}}`` (OpenAI's batch input format). Each request goes through the app ``sparrow serve``
serves (``build_app``), called in-process as an ASGI application: no socket, but the same
validation, handlers and error answers as the server's. Up to ``2 * max_num_seqs`` requests are in
flight at once, so the engine batches them.

Output: one line per input line, in the input's order, written as soon as the lines before it are
done (vLLM's shape)::

    {"id": "sparrow-<hex>", "custom_id": ..., "error": null,
     "response": {"status_code": 200, "request_id": "sparrow-batch-<hex>", "body": {...the response}}}

A request the API refuses has ``response.body`` null, its status code, and ``error`` set to the
server's error answer (``{"error": {message, type, param, code}}``). A line that is not a request
(bad JSON, missing or wrong field, an unsupported URL, ``stream: true``, a ``custom_id`` already
used) gets the same shape with status 400 and the field named in ``param``: a bad line fails alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from typing import IO, Any

from sparrow.entrypoints.openai.run_batch_args import BATCH_URLS

logger = logging.getLogger(__name__)

UPLOAD_ATTEMPTS = 3


class LineError(Exception):
    """A batch line that is not a request: answered with a 400 naming ``param`` (and echoing the
    line's ``custom_id`` when it had a readable one)."""

    def __init__(self, message: str, param: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.custom_id = custom_id


def parse_line(text: str, seen: dict[str, int], number: int) -> tuple[str, str, bytes]:
    """(custom_id, url, body as JSON bytes) of input line ``number`` (1-based), else LineError
    (``seen``: custom_id -> its line)."""
    try:
        line = json.loads(text)
    except ValueError as exc:
        raise LineError(f"line {number} is not JSON: {exc}", "line") from None
    if not isinstance(line, dict):
        raise LineError(f"line {number} must be a JSON object, got {type(line).__name__}", "line")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str):
        raise LineError(f"custom_id must be a string, got {custom_id!r}", "custom_id")
    if custom_id in seen:
        raise LineError(f"custom_id {custom_id!r} is already line {seen[custom_id]}'s; each request needs its own",
                        "custom_id", custom_id)
    seen[custom_id] = number
    if line.get("method") != "POST":
        raise LineError(f"method must be \"POST\", got {line.get('method')!r}", "method", custom_id)
    url = line.get("url")
    if url not in BATCH_URLS:
        raise LineError(f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}", "url", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body must be a JSON object (the request), got {type(body).__name__}", "body", custom_id)
    if body.get("stream"):
        raise LineError("body.stream: a batch request cannot stream; leave stream out or false", "body.stream",
                        custom_id)
    return custom_id, url, json.dumps(body).encode()


def result_line(custom_id: str | None, status: int, request_id: str, body: Any) -> str:
    ok = status == 200
    return json.dumps({"id": f"sparrow-{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body if ok else None},
                       "error": None if ok else body})


def error_body(message: str, param: str | None, status: int = 400) -> dict[str, Any]:
    """The server's error answer (``APIError.body``), for what never reached the app."""
    from sparrow.entrypoints.openai.api_errors import APIError

    if status < 500:
        return APIError(status, message, "BadRequestError", param=param, code="invalid_value").body()
    return APIError(status, message, "InternalServerError", param=param).body()


async def call_app(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """POST ``body`` to ``path`` of the ASGI ``app`` in this process; (status, response body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    delivered = False
    never = asyncio.Event()  # this client never disconnects

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    status, chunks = 500, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def input_lines(path: str) -> Iterator[str]:
    """The input's non-blank lines, read as they are needed."""
    if path == "-":
        stream: IO[Any] = sys.stdin
    elif _is_url(path):
        stream = urllib.request.urlopen(path, timeout=60)  # noqa: S310 - the user's own URL
    else:
        stream = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        for raw in stream:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            if text.strip():
                yield text
    finally:
        if stream is not sys.stdin:
            stream.close()


class OrderedWriter:
    """Writes result lines in input order as soon as every earlier line is done."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.pending: dict[int, str] = {}
        self.next = 0

    def put(self, index: int, line: str) -> None:
        self.pending[index] = line
        while self.next in self.pending:
            self.out.write(self.pending.pop(self.next) + "\n")
            self.next += 1
        self.out.flush()


async def run_batch(engine: Any, app: Any, lines: Iterator[str], writer: OrderedWriter,
                    progress: Any = None) -> int:
    """Run every line; return how many got an error result."""
    from sparrow.entrypoints.openai.cli_args import ENV_API_KEY

    api_key = os.environ.get(ENV_API_KEY)
    auth = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
    slots = asyncio.Semaphore(2 * engine.config.scheduler.max_num_seqs)
    seen: dict[str, int] = {}
    failed = 0

    async def one(index: int, custom_id: str | None, url: str, body: bytes) -> None:
        nonlocal failed
        request_id = f"sparrow-batch-{uuid.uuid4().hex}"
        try:
            status, raw = await call_app(app, url, body, [(b"x-request-id", request_id.encode()), *auth])
            answer = json.loads(raw) if raw else None
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own result
            status, answer = 500, error_body(f"{type(exc).__name__}: {exc}", None, 500)
        failed += status != 200
        writer.put(index, result_line(custom_id, status, request_id, answer))
        if progress is not None:
            progress.update()
        slots.release()

    tasks = []
    index = -1
    while True:
        # Read on a thread: standard input or a URL may be slow to give the next line, and the
        # requests already submitted must go on meanwhile.
        text = await asyncio.to_thread(next, lines, None)
        if text is None:
            break
        index += 1
        if progress is not None:
            progress.total = index + 1
        try:
            custom_id, url, body = parse_line(text, seen, index + 1)
        except LineError as exc:
            failed += 1
            writer.put(index, result_line(exc.custom_id, 400, f"sparrow-batch-{uuid.uuid4().hex}",
                                          error_body(str(exc), exc.param)))
            if progress is not None:
                progress.update()
            continue
        await slots.acquire()
        tasks.append(asyncio.create_task(one(index, custom_id, url, body)))
    await asyncio.gather(*tasks)
    return failed


def _upload(path: str, url: str) -> None:
    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            with open(path, "rb") as data:
                request = urllib.request.Request(url, data=data.read(), method="PUT",
                                                 headers={"Content-Type": "application/jsonl"})
            with urllib.request.urlopen(request, timeout=300) as response:  # noqa: S310 - the user's URL
                if response.status in (200, 201, 204):
                    return
                raise OSError(f"HTTP {response.status}")
        except OSError as exc:
            if attempt == UPLOAD_ATTEMPTS:
                raise OSError(f"--output-file: uploading the results to {url} failed {attempt} times, last: "
                              f"{exc}; they are kept in {path}") from None
            logger.warning("uploading the results to %s failed (%s); retrying", url, exc)


def run_batch_command(args: argparse.Namespace) -> int:
    """``sparrow run-batch``: returns the exit code."""
    from tqdm import tqdm

    from sparrow.engine.async_llm import AsyncLLM
    from sparrow.entrypoints.cli_errors import CommandFailed
    from sparrow.entrypoints.openai.api_server import build_app, check_api_flags

    kwargs = check_api_flags(args, "sparrow run-batch")
    if not (_is_url(args.input_file) or args.input_file == "-" or os.path.isfile(args.input_file)):
        raise CommandFailed(f"run-batch: --input-file {args.input_file!r} is not a file")
    upload_to = args.output_file if _is_url(args.output_file) else None
    if upload_to is not None:
        handle = tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="sparrow_batch_", dir=args.output_tmp_dir,
                                             delete=False, encoding="utf-8")
        out: IO[str] = handle
    else:
        out = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")  # noqa: SIM115
    engine = AsyncLLM.from_engine_args(**kwargs)
    try:
        if args.enable_metrics:
            from prometheus_client import start_http_server

            start_http_server(args.port, addr=args.url, registry=engine.metrics.registry)
            logger.info("metrics at http://%s:%d/metrics", args.url, args.port)
        app = build_app(engine, args)
        with tqdm(desc="Running batch", unit="req", total=0, file=sys.stderr) as progress:
            failed = asyncio.run(run_batch(engine, app, input_lines(args.input_file), OrderedWriter(out), progress))
        died = engine.dead_error  # before shutdown, which sets one of its own
    finally:
        engine.shutdown()
        if out is not sys.stdout:
            out.close()
    if upload_to is not None:
        _upload(out.name, upload_to)  # on failure the local copy stays (the error names it)
        os.unlink(out.name)
    logger.info("batch done: %d requests failed", failed)
    if died is not None:
        raise CommandFailed(f"run-batch: the engine died ({died}); the results written so far are in "
                            f"{args.output_file}")
    return 0

