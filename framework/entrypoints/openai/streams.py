"""Async plumbing of the endpoints: merging a request's streams (one per prompt or choice), their
last outputs for a whole response, and cancelling a full (non-streaming) response's work when its
client disconnects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, Callable, TypeVar

from fastapi import Request

from sparrow.engine.exceptions import EngineDeadError
from sparrow.entrypoints.openai.api_errors import APIError, bad_request, engine_dead
from sparrow.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async generators as they come, tagged with the generator's index.

    Leaving early (an error, a cancelled consumer) closes every stream, which aborts its request.
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Any] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
        finally:
            await stream.aclose()
            await queue.put(None)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            index, item = entry
            if isinstance(item, BaseException):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def cancel_on_disconnect(raw_request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work`` unless the client disconnects first; then cancel it (aborting its requests)
    and return None. Streaming responses get this from Starlette; full responses need it."""
    work_task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    listener = asyncio.create_task(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({work_task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        listener.cancel()
    if work_task in done:
        return work_task.result()
    logger.info("client disconnected; aborting its request")
    work_task.cancel()
    await asyncio.gather(work_task, return_exceptions=True)
    return None


async def collect_finals(streams: list[AsyncGenerator[Any, None]],
                         rejected: Callable[[ValueError], APIError] | None = None) -> list[Any]:
    """Every stream's last output, in the streams' order (a whole, non-streamed response); the
    engine's failures as the HTTP errors they are (a rejection through ``rejected``, by default
    a 400 naming the error's field)."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in merge_streams(streams):
            finals[index] = output
    except EngineDeadError as exc:
        raise engine_dead(exc) from None
    except ValueError as exc:
        raise (rejected or bad_request)(exc) from None  # the engine core rejected a request
    return [finals[index] for index in range(len(streams))]


async def collect_final(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """One stream's last output (see ``collect_finals``)."""
    return (await collect_finals([stream]))[0]
