"""vLLM's KV cache events (kv_events_config) from a real engine process to a real ZeroMQ SUB socket
on 127.0.0.1: every full prompt block cached is a BlockStored with its tokens and its parent's
hash (a shared prefix is not stored twice), every evicted one a BlockRemoved of a hash stored
before, reset_prefix_cache an AllBlocksCleared; batches are numbered in order under the topic."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError, EngineConfig
from sparrow.core.kv_cache_utils import hash_block_tokens
from sparrow.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BLOCK = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chain(token_ids: list[int]) -> list[bytes]:
    """The prefix-cache key of every full block of a base-model prompt without a salt."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + BLOCK]))
        hashes.append(bytes(parent))
    return hashes


def receive(sub) -> list[tuple[bytes, int, KVEventBatch]]:
    messages = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        messages.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload, type=KVEventBatch)))
    return messages


@pytest.fixture
def engine_and_subscriber(qwen3_dir):
    port = free_port()
    llm = LLM(qwen3_dir, max_model_len=256, block_size=BLOCK, num_kv_blocks=9, enable_chunked_prefill=True,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://*:{port}", "topic": "kv-events"})
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    # A subscription takes a moment to reach the publisher: clear the (empty) cache until the
    # AllBlocksCleared it publishes arrives, so that nothing the test sends is lost.
    deadline = time.monotonic() + 30
    while not sub.poll(100):
        assert time.monotonic() < deadline, "the subscriber never received an event"
        assert llm.reset_prefix_cache()
    while sub.poll(200):
        sub.recv_multipart()
    try:
        yield llm, sub
    finally:
        sub.close()
        context.term()
        llm.shutdown()


def test_stored_evicted_and_cleared_blocks_reach_a_subscriber(engine_and_subscriber):
    llm, sub = engine_and_subscriber
    first = list(range(1, 41))  # 2 full blocks
    shares_a_block = first[:16] + list(range(300, 324))  # its first block is first's
    others = [list(range(500 + 60 * i, 540 + 60 * i)) for i in range(3)]  # these evict
    for prompt in [first, shares_a_block, *others]:
        llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
    assert llm.reset_prefix_cache()
    messages = receive(sub)
    first_seq = messages[0][1]  # after the handshake's
    assert first_seq > 0 and [seq for _, seq, _ in messages] == list(range(first_seq, first_seq + len(messages)))
    assert {topic for topic, _, _ in messages} == {b"kv-events"}
    events = [event for _, _, batch in messages for event in batch.events]
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert stored[0].block_hashes == chain(first) and stored[0].parent_block_hash is None
    assert stored[0].token_ids == first[:32] and stored[0].block_size == BLOCK and stored[0].lora_id is None
    # The shared first block is a hit, not stored again: its second block hangs from first's first.
    assert stored[1].block_hashes == chain(shares_a_block)[1:]
    assert stored[1].parent_block_hash == chain(first)[0] and stored[1].token_ids == shares_a_block[16:32]
    for event, prompt in zip(stored[2:], others):
        assert event.block_hashes == chain(prompt)
    all_stored = {h for event in stored for h in event.block_hashes}
    removed = [h for event in events if isinstance(event, BlockRemoved) for h in event.block_hashes]
    assert removed and set(removed) <= all_stored and len(set(removed)) == len(removed)
    assert isinstance(events[-1], AllBlocksCleared)
    assert all(batch.data_parallel_rank is None and batch.ts > 0 for _, _, batch in messages)


def test_kv_events_config_is_checked_by_key():
    config = EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq"})
    assert config.cache.kv_events_config["endpoint"] == "tcp://*:5557"
    for value, words in [({"buffer_steps": 10}, "buffer_steps is not taken"),
                         ({"replay_endpoint": "tcp://*:5558"}, "no replay socket"),
                         ({"publisher": "kafka"}, "'zmq' or 'null'"),
                         ({"endpoint": "localhost:5557"}, "ZeroMQ endpoint"),
                         ({"hwm": -1}, "hwm must be"),
                         ({"topics": "x"}, "kv_events_config.topics is not a key")]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig.from_kwargs(kv_events_config=value)
    with pytest.raises(ConfigError, match="enable_prefix_caching is off"):
        EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True}, enable_prefix_caching=False)


def test_serve_takes_the_flag_and_the_null_publisher_opens_no_socket(qwen3_dir):
    from sparrow.engine.kv_events import rank_endpoint
    from sparrow.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "m", "--kv-events-config",
                                      '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "t"}'])
    assert EngineConfig.from_kwargs(**engine_kwargs(args)).cache.kv_events_config["topic"] == "t"
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    port = free_port()
    llm = LLM(qwen3_dir, multiprocess=False, max_model_len=128,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "null", "endpoint": f"tcp://*:{port}"})
    try:
        assert llm.llm_engine.engine_core.engine_core.kv_events is None
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # nobody bound it
    finally:
        llm.shutdown()
