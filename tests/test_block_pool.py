"""Property-based tests of the block pool, the free queue and the KV-cache manager.

Two state machines drive random operation sequences against a plain-Python model:
``BlockPoolMachine`` checks the pool's free-queue order (LRU), ref counts and hash index op by
op; ``KVCacheManagerMachine`` plays a scheduler (admit, decode, preempt, resume, finish) and
checks the invariants that the engine relies on.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sparrow.core.block_pool import BlockPool
from sparrow.core.kv_cache_manager import KVCacheManager
from sparrow.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    update_request_block_hashes,
)
from sparrow.core.request import Request
from sparrow.sampling_params import SamplingParams

MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None)


def make_request(request_id: str, prompt_token_ids: list[int], **sampling: object) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(**sampling))


def check_pool_invariants(pool: BlockPool) -> None:
    free_blocks = pool.free_block_queue.get_all_free_blocks()
    free_ids = [block.block_id for block in free_blocks]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        # Free queue and references are mutually exclusive and cover every block.
        assert (block.ref_cnt == 0) == (block.block_id in free_ids)
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block[block.block_hash][block.block_id] is block
    for block_hash, same_content in pool.cached_block_hash_to_block.items():
        assert same_content, "empty entries must be dropped from the index"
        for block_id, block in same_content.items():
            assert block.block_id == block_id and block.block_hash == block_hash


# -- FreeKVCacheBlockQueue ----------------------------------------------------------------------
def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_popleft_append_remove() -> None:
    blocks = [KVCacheBlock(block_id) for block_id in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == len(queue) == 5
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]

    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # middle
    queue.remove(blocks[4])  # tail
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    queue.append(blocks[0])
    queue.append(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 0, 4]
    queue.remove(blocks[1])  # head
    assert ids(queue.popleft_n(2)) == [3, 0]
    assert ids(queue.get_all_free_blocks()) == [4]
    queue.append_n([blocks[2], blocks[1]])
    assert ids(queue.get_all_free_blocks()) == [4, 2, 1]
    assert queue.num_free_blocks == 3


def test_free_queue_rejects_bad_ops() -> None:
    blocks = [KVCacheBlock(block_id) for block_id in range(3)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[1])
    with pytest.raises(ValueError, match="num_blocks"):
        queue.popleft_n(3)
    assert ids(queue.popleft_n(2)) == [0, 1]
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    assert queue.get_all_free_blocks() == []
    # An emptied queue works again.
    queue.append(blocks[2])
    assert queue.popleft() is blocks[2]


@given(st.permutations(range(8)), st.integers(0, 8))
def test_free_queue_single_block_remove_keeps_order(order: list[int], victim: int) -> None:
    blocks = [KVCacheBlock(block_id) for block_id in range(8)]
    queue = FreeKVCacheBlockQueue(blocks[block_id] for block_id in order)
    if victim < 8:
        queue.remove(blocks[victim])
        order = [block_id for block_id in order if block_id != victim]
    assert ids(queue.get_all_free_blocks()) == order


# -- BlockPool unit tests ------------------------------------------------------------------------
def test_free_blocks_never_negative() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="ref_cnt would go negative"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    # Freeing the same block twice in one call with ref_cnt 1 is caught before any change.
    (other,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="ref_cnt"):
        pool.free_blocks([other, other])
    assert other.ref_cnt == 1
    check_pool_invariants(pool)


def test_get_new_blocks_raises_when_not_enough_free() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="num_blocks"):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_usage_and_reset_prefix_cache() -> None:
    pool = BlockPool(4)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    update_request_block_hashes(request, 2)
    blocks = pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(0.75)
    pool.cache_full_blocks(request, blocks, 0, 3, 2)
    assert pool.reset_prefix_cache() is False  # blocks in use
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert all(block.block_hash is None for block in pool.blocks)


def test_cache_block_indexes_a_block_under_a_callers_key() -> None:
    """cache_block, as the draft model's cache keys its blocks: a held block is found after its
    holder lets go, a block already indexed keeps its hash, and two blocks may share one key."""
    pool = BlockPool(3)
    first, second, third = pool.get_new_blocks(3)
    key = hash_block_tokens(None, (1, 2, 3, 4))
    pool.cache_block(first, key)
    pool.cache_block(first, hash_block_tokens(None, (5, 6, 7, 8)))  # already indexed: unchanged
    pool.cache_block(second, key)  # the same content computed twice
    assert first.block_hash == second.block_hash == key and third.block_hash is None
    pool.free_blocks([third, second, first])
    assert pool.get_cached_block(key) in (first, second)
    assert pool.get_new_blocks(1) == [third]  # the uncached block goes first
    pool.get_new_blocks(1)
    assert pool.get_cached_block(key) is not None  # one copy evicted, the other still a hit
    check_pool_invariants(pool)


@given(st.permutations(range(6)), st.integers(0, 6))
def test_eviction_is_lru(free_order: list[int], num_reused: int) -> None:
    """The block freed longest ago is handed out (and its cached content evicted) first."""
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(6)
    request = make_request("a", list(range(12)))
    update_request_block_hashes(request, 2)
    pool.cache_full_blocks(request, blocks, 0, 6, 2)
    for block_id in free_order:
        pool.free_blocks([pool.blocks[block_id]])
    reused = pool.get_new_blocks(num_reused)
    assert ids(reused) == free_order[:num_reused]
    for block in reused:
        assert block.block_hash is None
        assert block.ref_cnt == 1
    # What was not reused is still a prefix-cache hit.
    for block_id in free_order[num_reused:]:
        assert pool.get_cached_block(request.block_hashes[block_id]) is pool.blocks[block_id]
    check_pool_invariants(pool)


# -- hashing ---------------------------------------------------------------------------------
token_lists = st.lists(st.integers(0, 50_000), min_size=8, max_size=40)


@given(token_lists, st.data())
def test_early_difference_changes_every_later_hash(
    token_ids: list[int], data: st.DataObject
) -> None:
    block_size = 4
    position = data.draw(st.integers(0, len(token_ids) - 1), label="position")
    changed = list(token_ids)
    changed[position] += 1
    first = make_request("a", token_ids)
    second = make_request("b", changed)
    update_request_block_hashes(first, block_size)
    update_request_block_hashes(second, block_size)
    changed_block = position // block_size
    for index, (hash_a, hash_b) in enumerate(zip(first.block_hashes, second.block_hashes)):
        if index < changed_block:
            assert hash_a == hash_b
        else:
            assert hash_a != hash_b


@given(token_lists, st.integers(1, 7))
def test_incremental_hashes_equal_batch_hashes(token_ids: list[int], block_size: int) -> None:
    incremental = make_request("a", token_ids[:3])
    for token_id in token_ids[3:]:
        incremental.append_output_token_ids(token_id)
        update_request_block_hashes(incremental, block_size)
    batch = make_request("b", token_ids)
    assert update_request_block_hashes(batch, block_size) == incremental.block_hashes
    assert len(batch.block_hashes) == len(token_ids) // block_size


def test_hash_is_stable_and_keyed_by_extra_keys() -> None:
    block_hash = hash_block_tokens(None, (1, 2, 3))
    # A fixed value: the hash must not depend on the process (PYTHONHASHSEED, restarts).
    assert block_hash.hex() == hash_block_tokens(None, (1, 2, 3)).hex()
    assert isinstance(block_hash, bytes) and len(block_hash) == 32
    assert hash_block_tokens(None, (1, 2, 3), ("lora-a",)) != block_hash
    assert hash_block_tokens(block_hash, (1, 2, 3)) != block_hash
    with pytest.raises(TypeError, match="extra_keys"):
        hash_block_tokens(None, (1,), (object(),))


def test_a_cache_salt_keys_every_block_and_adds_to_the_lora_key() -> None:
    from sparrow.lora.request import LoRARequest

    hashes = {}
    for label, salt, lora in (("plain", None, None), ("a", "a", None), ("a too", "a", None), ("b", "b", None),
                              ("lora", None, LoRARequest("x", 1, "/x")), ("lora a", "a", LoRARequest("x", 1, "/x"))):
        request = make_request(label, list(range(8)))
        request.cache_salt, request.lora_request = salt, lora
        hashes[label] = update_request_block_hashes(request, 4)
    assert hashes["a"] == hashes["a too"]
    others = [hashes[label] for label in ("plain", "a", "b", "lora", "lora a")]
    # Every block of each kind differs from the same block of every other kind.
    assert all(len({blocks[index] for blocks in others}) == len(others) for index in range(2))


# -- state machine: the pool against a list model ------------------------------------------------
class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / touch / free sequences; the model is a list (the LRU order), of
    which blocks without cached content are handed out first (``_model_order``)."""

    BLOCK_SIZE = 2

    @initialize(num_blocks=st.integers(1, 8))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.model_free: list[int] = list(range(num_blocks))  # head first
        self.model_ref_cnt = [0] * num_blocks
        # Each holder is a request owning one reference on each of its blocks.
        self.holders: list[tuple[Request, list[KVCacheBlock]]] = []
        self.num_requests = 0

    def _model_order(self) -> list[int]:
        # Reusing a block without cached content evicts nothing: those go first, in free order.
        uncached = [block_id for block_id in self.model_free if self.pool.blocks[block_id].block_hash is None]
        cached = [block_id for block_id in self.model_free if self.pool.blocks[block_id].block_hash is not None]
        return uncached + cached

    def _new_request(self, token_ids: list[int]) -> Request:
        self.num_requests += 1
        request = make_request(f"r{self.num_requests}", token_ids)
        update_request_block_hashes(request, self.BLOCK_SIZE)
        return request

    @rule(num_blocks=st.integers(0, 10), token_ids=st.lists(st.integers(0, 2), max_size=20))
    def allocate(self, num_blocks: int, token_ids: list[int]) -> None:
        if num_blocks > len(self.model_free):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(num_blocks)
            return
        self.model_free = self._model_order()
        blocks = self.pool.get_new_blocks(num_blocks)
        assert ids(blocks) == self.model_free[:num_blocks]
        del self.model_free[:num_blocks]
        for block in blocks:
            assert block.block_hash is None, "a reused block's cached content must be evicted"
            self.model_ref_cnt[block.block_id] += 1
        self.holders.append((self._new_request(token_ids), blocks))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        request, blocks = data.draw(st.sampled_from(self.holders), label="holder")
        num_full_blocks = min(len(blocks), len(request.block_hashes))
        self.pool.cache_full_blocks(request, blocks, 0, num_full_blocks, self.BLOCK_SIZE)
        for index, block in enumerate(blocks[:num_full_blocks]):
            assert block.block_hash is not None
            if block.block_hash == request.block_hashes[index]:
                assert self.pool.get_cached_block(block.block_hash) is not None

    @precondition(lambda self: self.pool.cached_block_hash_to_block)
    @rule(data=st.data())
    def touch_cached(self, data: st.DataObject) -> None:
        block_hash = data.draw(st.sampled_from(sorted(self.pool.cached_block_hash_to_block)))
        block = self.pool.get_cached_block(block_hash)
        assert block is not None and block.block_hash == block_hash
        self.pool.touch([block])
        if self.model_ref_cnt[block.block_id] == 0:
            self.model_free.remove(block.block_id)
        self.model_ref_cnt[block.block_id] += 1
        self.holders.append((self._new_request([]), [block]))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        holder = data.draw(st.sampled_from(self.holders), label="holder")
        self.holders.remove(holder)
        order = data.draw(st.permutations(holder[1]), label="free order")
        self.pool.free_blocks(order)
        for block in order:
            self.model_ref_cnt[block.block_id] -= 1
            if self.model_ref_cnt[block.block_id] == 0:
                self.model_free.append(block.block_id)

    @rule(block_id=st.integers(0, 7))
    def free_unheld_raises(self, block_id: int) -> None:
        if block_id >= self.pool.num_blocks or self.model_ref_cnt[block_id] > 0:
            return
        with pytest.raises(ValueError, match="negative"):
            self.pool.free_blocks([self.pool.blocks[block_id]])

    @rule()
    def reset_prefix_cache(self) -> None:
        in_use = any(self.model_ref_cnt)
        order = self._model_order()  # a reset keeps the order of the moment, all uncached
        assert self.pool.reset_prefix_cache() is (not in_use)
        if not in_use:
            self.model_free = order
        if not in_use:
            assert not self.pool.cached_block_hash_to_block

    @invariant()
    def matches_model(self) -> None:
        assert ids(self.pool.free_block_queue.get_all_free_blocks()) == self._model_order()
        assert [block.ref_cnt for block in self.pool.blocks] == self.model_ref_cnt
        check_pool_invariants(self.pool)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for _, blocks in self.holders:
            self.pool.free_blocks(reversed(blocks))
        assert self.pool.get_num_free_blocks() == self.pool.num_blocks
        check_pool_invariants(self.pool)


BlockPoolMachine.TestCase.settings = MACHINE_SETTINGS
TestBlockPoolMachine = BlockPoolMachine.TestCase


# -- state machine: the manager driven like a scheduler ------------------------------------------
SHARED_PREFIXES = ((), (7, 7, 1, 2, 3, 4, 5, 6), (7, 7, 1, 2, 9, 9, 9, 9, 8))


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Admit, decode, preempt, resume and finish requests; prompts share a few prefixes."""

    BLOCK_SIZE = 4

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(num_blocks=10, block_size=self.BLOCK_SIZE)
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.num_requests = 0

    def _snapshot(self) -> tuple:
        pool = self.manager.block_pool
        return (
            ids(pool.free_block_queue.get_all_free_blocks()),
            [(block.ref_cnt, block.block_hash) for block in pool.blocks],
            {rid: ids(blocks) for rid, blocks in self.manager.req_to_blocks.items()},
        )

    def _admit(self, request: Request) -> None:
        """What the scheduler does for a waiting request, with the whole rest as one chunk."""
        hit_blocks, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens == len(hit_blocks.blocks) * self.BLOCK_SIZE
        assert num_hit_tokens <= request.num_tokens - 1, "the last token is always recomputed"
        for index, block in enumerate(hit_blocks.blocks):
            assert block.block_hash == request.block_hashes[index]
        before = self._snapshot()
        new_blocks = self.manager.allocate_slots(
            request, request.num_tokens - num_hit_tokens, num_hit_tokens, hit_blocks
        )
        if new_blocks is None:
            assert self._snapshot() == before, "a failed allocation must change nothing"
            self.waiting.append(request)
            return
        assert all(block.ref_cnt >= 1 for block in new_blocks.blocks)
        assert self.manager.get_block_ids(request.request_id) == (
            hit_blocks.get_block_ids() + new_blocks.get_block_ids()
        )
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids(request.num_tokens % 5)
        self.running[request.request_id] = request

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        del self.running[request.request_id]
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.insert(0, request)

    def _running_in_order(self) -> list[Request]:
        return [self.running[request_id] for request_id in sorted(self.running)]

    @rule(
        prefix=st.sampled_from(SHARED_PREFIXES),
        suffix=st.lists(st.integers(0, 9), min_size=1, max_size=14),
    )
    def add_request(self, prefix: tuple[int, ...], suffix: list[int]) -> None:
        self.num_requests += 1
        request = make_request(f"req-{self.num_requests}", list(prefix) + suffix)
        if not self.manager.can_fit(request.num_tokens + 1):
            return
        self._admit(request)

    @precondition(lambda self: self.waiting)
    @rule()
    def resume(self) -> None:
        self._admit(self.waiting.pop(0))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self._running_in_order()), label="request")
        before = self._snapshot()
        new_blocks = self.manager.allocate_slots(request, 1)
        if new_blocks is None:
            assert self._snapshot() == before, "a failed allocation must change nothing"
            self._preempt(request)
            return
        request.num_computed_tokens += 1
        request.append_output_token_ids(data.draw(st.integers(0, 9), label="sampled token"))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self._running_in_order()), label="request")
        self.manager.free(request)
        del self.running[request.request_id]

    @rule()
    def finish_all(self) -> None:
        for request in list(self.running.values()):
            self.manager.free(request)
        self.running.clear()
        self.waiting.clear()
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert self.manager.usage == 0.0

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager.reset_prefix_cache() is (not self.running)

    @invariant()
    def blocks_accounted_for(self) -> None:
        pool = self.manager.block_pool
        check_pool_invariants(pool)
        assert set(self.manager.req_to_blocks) == set(self.running)
        # ref_cnt == number of running requests holding the block.
        holders = [0] * pool.num_blocks
        for request_id, blocks in self.manager.req_to_blocks.items():
            request = self.running[request_id]
            assert len(blocks) * self.BLOCK_SIZE >= request.num_computed_tokens
            for index, block in enumerate(blocks):
                holders[block.block_id] += 1
                if block.block_hash is not None:
                    # A cached block's content is exactly this request's prefix.
                    assert block.block_hash == request.block_hashes[index]
        assert [block.ref_cnt for block in pool.blocks] == holders
        assert self.manager.num_free_blocks == holders.count(0)

    def teardown(self) -> None:
        for request in list(self.running.values()):
            self.manager.free(request)
        assert self.manager.num_free_blocks == self.manager.num_blocks


KVCacheManagerMachine.TestCase.settings = MACHINE_SETTINGS
TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase


def test_shared_prefix_hit_across_requests() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = make_request("first", prompt)
    blocks, num_hit_tokens = manager.get_computed_blocks(first)
    assert num_hit_tokens == 0
    assert manager.allocate_slots(first, first.num_tokens, 0, blocks) is not None
    first.num_computed_tokens = first.num_tokens

    second = make_request("second", prompt + [1, 2, 3])
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert hit_blocks.get_block_ids() == manager.get_block_ids("first")[:2]
    new_blocks = manager.allocate_slots(second, second.num_tokens - 8, 8, hit_blocks)
    assert new_blocks is not None
    assert [block.ref_cnt for block in hit_blocks.blocks] == [2, 2]
    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == 8
