"""The mailbox between AsyncLLM's output handler and one ``generate()`` consumer."""

from __future__ import annotations

import asyncio

from sparrow.outputs import RequestOutput
from sparrow.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """The mailbox between the output handler and one ``generate()`` consumer.

    Holds at most one pending output: a consumer that falls behind gets the outputs merged
    (DELTA: appended; CUMULATIVE: the latest), never a growing backlog. An error replaces
    whatever is pending and stays.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if isinstance(self._pending, BaseException):
            return
        if self._pending is None or isinstance(output, BaseException):
            self._pending = output
        else:
            self._pending.add(output, aggregate=self.aggregate)
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        pending, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(pending, BaseException):
            raise pending
        return pending

    async def get(self) -> RequestOutput:
        while self._pending is None:
            await self._ready.wait()
        output = self.get_nowait()
        assert output is not None
        return output
