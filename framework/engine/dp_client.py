"""Data parallel: N engine cores behind one frontend.

``DPClient`` has the interface of ``SyncMPClient`` / ``InprocClient`` (for ``LLM``) and
``AsyncDPClient`` that of ``AsyncMPClient`` (for ``AsyncLLM``); each wraps one such client per
engine core. Each core is a full engine (its own scheduler, KV cache and workers, tensor
parallel or not); nothing is shared between them, so they scale throughput, not model size.

    add_request       -> the core with the fewest unfinished requests (ties: the lowest index)
    abort_requests    -> each request's owning core
    get_output        <- whatever any core produced, merged into one EngineCoreOutputs
    call_utility      -> every core; results combined per method (see ``_combine``)

Multiprocess cores produce outputs on their own; one forwarding thread per core (an asyncio task
for the async client) moves them into a single queue, so ``get_output`` wakes for the first core
that has something. In-process cores (``SPARROW_ENABLE_MULTIPROCESSING=0``) are stepped in turn
by ``get_output`` itself.

A client that is dropped shuts its cores down when it is collected (``weakref.finalize``; at
interpreter exit at the latest): the forwarders hold the per-core clients, never the router.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sparrow.config import EngineConfig
from sparrow.engine.exceptions import EngineDeadError
from sparrow.engine.messages import SCHEDULER_STATS_COUNTERS, EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)


def start_clients(count: int, make: Any, parallel: bool) -> list[Any]:
    """``[make(0), ..., make(count - 1)]``, started side by side when ``parallel`` (most of a
    start-up is a child process importing torch and loading weights); all or none."""
    clients: list[Any] = []
    errors: list[BaseException] = []
    if parallel:
        with ThreadPoolExecutor(count, thread_name_prefix="DPClientStart") as pool:
            futures = [pool.submit(make, index) for index in range(count)]
        for future in futures:
            if future.exception() is None:
                clients.append(future.result())
            else:
                errors.append(future.exception())
    else:
        try:
            for index in range(count):
                clients.append(make(index))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the clean-up
            errors.append(exc)
    if errors:
        for client in clients:
            client.shutdown()
        raise errors[0]
    return clients


def per_engine_config(config: EngineConfig, index: int = 0) -> EngineConfig:
    """Engine ``index``'s configuration: a single engine that knows its data-parallel rank, so its
    workers take the devices after those of the lower ranks (cuda:index*tp ...)."""
    parallel = config.parallel.model_copy(update={"data_parallel_size": 1, "data_parallel_rank": index})
    return config.model_copy(update={"parallel": parallel})


class DPRouter:
    """Routing state shared by the sync and async clients: which core owns which request."""

    def __init__(self, clients: list[Any]) -> None:
        self.clients = clients
        self.data_parallel_size = len(clients)
        self._owner: dict[str, int] = {}  # request_id -> index of the core that runs it
        self._num_unfinished = [0] * self.data_parallel_size
        # Per core: requests received and requests it finished (observability, tests).
        self.num_requests_routed = [0] * self.data_parallel_size
        self.num_requests_finished = [0] * self.data_parallel_size
        self._latest_stats: list[SchedulerStats | None] = [None] * self.data_parallel_size
        self._lock = threading.Lock()  # guards the routing state (aborts may come from any thread)
        self._dead_error: EngineDeadError | None = None

    def _route(self, request_id: str, rank: int | None = None) -> int:
        """The engine for a new request: ``rank`` when the caller chose one (vLLM's
        data_parallel_rank, checked by the frontend), else the one with the fewest unfinished."""
        with self._lock:
            index = rank if rank is not None else \
                min(range(self.data_parallel_size), key=lambda i: (self._num_unfinished[i], i))
            self._owner[request_id] = index
            self._num_unfinished[index] += 1
            self.num_requests_routed[index] += 1
            return index

    def _forget(self, request_id: str) -> int | None:
        with self._lock:
            index = self._owner.pop(request_id, None)
            if index is not None:
                self._num_unfinished[index] -= 1
            return index

    def _aborts_by_core(self, request_ids: list[str]) -> dict[int, list[str]]:
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._forget(request_id)
            if index is not None:
                by_core.setdefault(index, []).append(request_id)
        return by_core

    def _merge(self, items: list[tuple[int, EngineCoreOutputs | EngineDeadError]]) -> EngineCoreOutputs:
        """One EngineCoreOutputs from what the cores produced; raises once a core is dead and
        nothing else is left to deliver (one dead core strands its requests: all is dead)."""
        merged = EngineCoreOutputs(outputs=[])
        has_stats = has_outputs = False
        for index, item in items:
            if isinstance(item, EngineDeadError):
                if self._dead_error is None:
                    self._dead_error = EngineDeadError(f"data-parallel engine core {index} died: {item}")
                continue
            has_outputs = True
            for output in item.outputs:
                if output.finished and self._forget(output.request_id) is not None:
                    self.num_requests_finished[index] += 1
                merged.outputs.append(output)
            if item.scheduler_stats is not None:
                has_stats = True
                self._latest_stats[index] = item.scheduler_stats
            merged.timestamp = max(merged.timestamp, item.timestamp)
        if not has_outputs and self._dead_error is not None:
            raise self._dead_error
        if has_stats:
            merged.scheduler_stats = combine_stats([s for s in self._latest_stats if s is not None])
        return merged

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error


def _shutdown_engines(clients: list[Any], forwarders: list[threading.Thread]) -> None:
    """Shut every core down (the finalizer of both clients: it must not refer to the client)."""
    for client in clients:
        try:
            client.shutdown()
        except Exception:  # noqa: BLE001 - shut the others down anyway
            logger.exception("shutting down a data-parallel engine core failed")
    # Each forwarder ends by itself: its client's shutdown delivers EngineDeadError to it.
    for thread in forwarders:
        if thread is not threading.current_thread():
            thread.join(timeout=5.0)


def _forward_outputs(index: int, client: Any, merged: queue.Queue) -> None:
    """A forwarder thread of DPClient: core ``index``'s outputs into the merged queue."""
    while True:
        try:
            outputs = client.get_output()
        except EngineDeadError as exc:
            merged.put((index, exc))
            return
        except Exception as exc:  # noqa: BLE001 - a silent forwarder would hang get_output
            logger.exception("data-parallel engine core %d: reading outputs failed", index)
            merged.put((index, EngineDeadError(f"reading its outputs failed: {exc!r}")))
            return
        merged.put((index, outputs))


async def _forward_outputs_async(index: int, client: Any, merged: asyncio.Queue) -> None:
    """A forwarder task of AsyncDPClient."""
    while True:
        try:
            outputs = await client.get_output_async()
        except EngineDeadError as exc:
            merged.put_nowait((index, exc))
            return
        merged.put_nowait((index, outputs))


class DPClient(DPRouter):
    """The synchronous client (``LLM``): the interface of SyncMPClient / InprocClient."""

    def __init__(self, config: EngineConfig, multiprocess: bool | None = None,
                 executor_factory: str | None = None) -> None:
        from sparrow.engine.mp_client import make_client, multiprocessing_enabled

        self.multiprocess = multiprocessing_enabled() if multiprocess is None else multiprocess
        super().__init__(start_clients(
            config.parallel.data_parallel_size,
            lambda index: make_client(per_engine_config(config, index), self.multiprocess,
                                      executor_factory=executor_factory),
            parallel=self.multiprocess))
        self._merged: queue.Queue[tuple[int, EngineCoreOutputs | EngineDeadError]] = queue.Queue()
        self._forwarders: list[threading.Thread] = []
        if self.multiprocess:
            for index, client in enumerate(self.clients):
                thread = threading.Thread(target=_forward_outputs, args=(index, client, self._merged),
                                          name=f"DPClientOutputs-{index}", daemon=True)
                thread.start()
                self._forwarders.append(thread)
        self._finalizer = weakref.finalize(self, _shutdown_engines, self.clients, self._forwarders)

    @property
    def kv_cache_info(self) -> dict[str, int]:
        return self.call_utility("get_kv_cache_info")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._raise_if_dead()
        index = self._route(request.request_id, request.data_parallel_rank)
        try:
            self.clients[index].add_request(request)
        except BaseException:
            self._forget(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for index, ids in self._aborts_by_core(request_ids).items():
            self.clients[index].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        """The outputs of every core that has produced some (waits for the first one)."""
        self._raise_if_dead()
        if not self.multiprocess:
            # In-process cores compute inside get_output: step each once.
            return self._merge([(index, client.get_output()) for index, client in enumerate(self.clients)])
        items = [self._merged.get()]
        while True:
            try:
                items.append(self._merged.get_nowait())
            except queue.Empty:
                return self._merge(items)

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every core and combine the results (see ``_combine``)."""
        self._raise_if_dead()
        return _combine(method, [client.call_utility(method, *args) for client in self.clients])

    def shutdown(self) -> None:
        self._finalizer()


class AsyncDPClient(DPRouter):
    """The asyncio client (``AsyncLLM``): the interface of AsyncMPClient."""

    def __init__(self, config: EngineConfig, executor_factory: str | None = None) -> None:
        from sparrow.engine.mp_client import AsyncMPClient

        super().__init__(start_clients(
            config.parallel.data_parallel_size,
            lambda index: AsyncMPClient(per_engine_config(config, index), executor_factory=executor_factory),
            parallel=True))
        self.kv_cache_info = _combine("get_kv_cache_info", [client.kv_cache_info for client in self.clients])
        self._merged: asyncio.Queue | None = None
        self._forwarders: list[asyncio.Task] = []
        self._finalizer = weakref.finalize(self, _shutdown_engines, self.clients, [])

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None or any(client.is_dead for client in self.clients)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error or next((c.dead_error for c in self.clients if c.dead_error is not None), None)

    def _start_forwarders(self) -> asyncio.Queue:
        # Bound to the event loop of the first call, like AsyncMPClient.
        if self._merged is None:
            self._merged = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self._forwarders = [loop.create_task(_forward_outputs_async(index, client, self._merged),
                                                 name=f"DPClientOutputs-{index}")
                                for index, client in enumerate(self.clients)]
        return self._merged

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._start_forwarders()
        self._raise_if_dead()
        index = self._route(request.request_id, request.data_parallel_rank)
        try:
            await self.clients[index].add_request_async(request)
        except BaseException:
            self._forget(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for index, ids in self._aborts_by_core(request_ids).items():
            self.clients[index].abort_requests(ids)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        merged = self._start_forwarders()
        self._raise_if_dead()
        items = [await merged.get()]
        while not merged.empty():
            items.append(merged.get_nowait())
        return self._merge(items)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._raise_if_dead()
        results = await asyncio.gather(*(client.call_utility_async(method, *args) for client in self.clients))
        return _combine(method, list(results))

    def shutdown(self) -> None:
        self._finalizer()


def combine_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """One SchedulerStats for all cores, from each core's latest: gauges and cumulative counters
    summed (so the combined counters are cumulative too), usage over all their blocks."""
    total_blocks = sum(s.num_total_blocks for s in stats)
    free_blocks = sum(s.num_free_blocks for s in stats)
    if total_blocks:
        usage = (total_blocks - free_blocks) / total_blocks
    else:
        usage = sum(s.kv_cache_usage for s in stats) / max(1, len(stats))
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=usage, num_free_blocks=free_blocks, num_total_blocks=total_blocks,
        **{name: sum(getattr(s, name) for s in stats) for name in SCHEDULER_STATS_COUNTERS},
    )


def _combine(method: str, results: list[Any]) -> Any:
    """Per-core utility results -> one result.

    get_kv_cache_info: the smallest core's num_blocks (any request may land on any core), summed
    free blocks; reset_prefix_cache: True only if every core reset; is_sleeping, is_scheduler_paused:
    whether any core is; collective_rpc and profile: every core's worker results, core after core;
    get_scheduler_stats: combined like the stats of outputs; any other method: the first core's
    result (the call still reached every core).
    """
    if method == "get_kv_cache_info":
        combined = dict(min(results, key=lambda info: info["num_blocks"]))
        if all("num_free_blocks" in info for info in results):
            combined["num_free_blocks"] = sum(info["num_free_blocks"] for info in results)
        return combined
    if method == "reset_prefix_cache":
        return all(results)
    if method in ("is_sleeping", "is_scheduler_paused"):
        return any(results)
    if method in ("collective_rpc", "profile"):
        return [item for result in results for item in result]
    if method == "get_scheduler_stats":
        return combine_stats(results)
    return results[0]

