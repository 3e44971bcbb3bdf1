"""vLLM's KV cache events (``kv_events_config``): the engine core publishes what enters and leaves
its prefix cache, so that a KV-aware router (llm-d, Dynamo) can send a request to the engine that
holds its prefix.

The block pool records ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (sparrow.wire)
as they happen; after every engine step the engine core sends them as one ``KVEventBatch`` on a
ZeroMQ PUB socket, as vLLM's ``zmq`` publisher does: a three-frame message of the topic, a sequence
number (8 bytes, big-endian, from 0) and the msgpack batch. An endpoint with ``*`` (or an ``ipc://``
one) is bound, another is connected to. With data parallelism each replica's engine core
publishes on the endpoint's port plus its rank. A subscriber that falls behind loses messages
beyond ``hwm`` (ZeroMQ's send high-water mark); there is no replay socket.

    sub = zmq.Context().socket(zmq.SUB); sub.connect("tcp://127.0.0.1:5557")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    topic, seq, payload = sub.recv_multipart()
    batch = msgspec.msgpack.decode(payload, type=sparrow.wire.KVEventBatch)
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from sparrow.wire import KVEventBatch

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {"enable_kv_cache_events": False, "publisher": "null", "endpoint": "tcp://*:5557",
                            "topic": "", "hwm": 100_000, "replay_endpoint": None}
# vLLM's keys for its replay buffer and publisher queue, which Sparrow does not have.
_NOT_TAKEN = {"buffer_steps": "there is no replay buffer", "max_queue_size": "events are sent from the step loop, "
              "with no queue of their own (hwm bounds ZeroMQ's)"}


def check_kv_events_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with vLLM's defaults filled in; ValueError naming a key that is wrong."""
    for key in config:
        if key in _NOT_TAKEN:
            raise ValueError(f"kv_events_config.{key} is not taken: {_NOT_TAKEN[key]}")
        if key not in DEFAULTS:
            raise ValueError(f"kv_events_config.{key} is not a key; the keys are {', '.join(DEFAULTS)}")
    out = {**DEFAULTS, **config}
    if not isinstance(out["enable_kv_cache_events"], bool):
        raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
    if out["publisher"] not in ("null", "zmq"):
        raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {out['publisher']!r}")
    for key in ("endpoint", "topic"):
        if not isinstance(out[key], str):
            raise ValueError(f"kv_events_config.{key} must be a string")
    if not out["endpoint"].startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"kv_events_config.endpoint must be a ZeroMQ endpoint (tcp://host:port, ipc://path), got "
                         f"{out['endpoint']!r}")
    if isinstance(out["hwm"], bool) or not isinstance(out["hwm"], int) or out["hwm"] < 0:
        raise ValueError("kv_events_config.hwm must be an integer >= 0")
    if out["replay_endpoint"] is not None:
        raise ValueError("kv_events_config.replay_endpoint is not taken: there is no replay socket")
    return out


def publishes(config: dict[str, Any] | None) -> bool:
    return config is not None and config["enable_kv_cache_events"] and config["publisher"] == "zmq"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """A data-parallel replica's endpoint: a tcp endpoint's port plus ``rank``."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 else f"{endpoint}-{rank}"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}"


class KVEventPublisher:
    """The ZeroMQ PUB socket of one engine core; ``publish`` never blocks."""

    def __init__(self, config: dict[str, Any], data_parallel_rank: int = 0,
                 data_parallel_size: int = 1) -> None:
        import zmq

        self.topic = config["topic"].encode()
        self.rank = data_parallel_rank if data_parallel_size > 1 else None
        self.endpoint = rank_endpoint(config["endpoint"], data_parallel_rank)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config["hwm"])
        self._socket.setsockopt(zmq.LINGER, 0)
        if "*" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(self.endpoint)
        else:
            self._socket.connect(self.endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again
        logger.info("KV cache events on %s (topic %r)", self.endpoint, config["topic"])

    def publish(self, events: list[Any]) -> None:
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank))
        try:
            self._socket.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload], flags=self._noblock)
        except self._again:  # past the high-water mark: this batch is lost to the slow subscribers
            pass
        self._seq += 1

    def close(self) -> None:
        self._socket.close()
        self._context.term()


def start_kv_events(config: Any, block_pool: Any) -> KVEventPublisher | None:
    """The engine core's publisher (``config.cache.kv_events_config``), with ``block_pool``
    recording events for it; None when events are off."""
    if not publishes(config.cache.kv_events_config):
        return None
    block_pool.kv_events = []
    return KVEventPublisher(config.cache.kv_events_config, config.parallel.data_parallel_rank,
                            config.parallel.data_parallel_size)
