"""KVCacheManager: prefix hits, the last-token rule, check-then-act allocation, free order,
reset, stats and can_fit."""

from __future__ import annotations

import pytest

from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from sparrow.core.request import Request
from sparrow.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt_token_ids: list[int], **sampling: object) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(**sampling))


def admit(manager: KVCacheManager, request: Request) -> KVCacheBlocks | None:
    """Schedule the whole uncached rest of the prompt in one step, as the scheduler would."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hit_blocks
    )
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return new_blocks


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def test_miss_then_hit_while_running_and_after_finish() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = list(range(10))  # blocks [0..3] [4..7] [8 9]
    first = make_request("first", prompt)
    assert manager.get_computed_blocks(first) == (KVCacheBlocks([]), 0)
    assert admit(manager, first) is not None
    first_ids = manager.get_block_ids("first")
    assert len(first_ids) == 3

    # While "first" runs its two full blocks are shared.
    second = make_request("second", prompt + [42])
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert hit_blocks.get_block_ids() == first_ids[:2]

    # After "first" finishes, its blocks are free but still cached: a hit revives them.
    manager.free(first)
    assert manager.num_free_blocks == 10
    new_blocks = admit(manager, second)
    assert new_blocks is not None
    assert manager.get_block_ids("second")[:2] == first_ids[:2]
    assert len(new_blocks.blocks) == 1  # only the newly allocated block is returned
    assert manager.num_free_blocks == 10 - 3
    assert all(block.ref_cnt == 1 for block in manager.get_blocks("second").blocks)


def test_miss_on_different_first_block() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(12))))
    # Same tokens from block 1 on, but block 0 differs: the chain makes every block a miss.
    other = make_request("b", [99] + list(range(1, 12)))
    assert manager.get_computed_blocks(other)[1] == 0


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit_tokens"),
    [(4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)],
)
def test_last_prompt_token_is_always_recomputed(prompt_len: int, expected_hit_tokens: int) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = list(range(prompt_len))
    admit(manager, make_request("warm", prompt + [7, 7, 7, 7]))
    _, num_hit_tokens = manager.get_computed_blocks(make_request("again", prompt))
    assert num_hit_tokens == expected_hit_tokens
    assert num_hit_tokens <= prompt_len - 1


def test_no_lookup_with_prompt_logprobs_or_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, make_request("warm", list(range(12))))
    assert manager.make_prefix_cache_stats().requests == 1
    wants_logprobs = make_request("lp", list(range(12)), prompt_logprobs=1)
    assert manager.get_computed_blocks(wants_logprobs) == (KVCacheBlocks([]), 0)
    assert manager.make_prefix_cache_stats().requests == 1  # not looked up, not counted

    uncached = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    admit(uncached, make_request("warm", list(range(12))))
    assert uncached.get_computed_blocks(make_request("again", list(range(12))))[1] == 0
    assert all(block.block_hash is None for block in uncached.block_pool.blocks)
    assert not uncached.block_pool.cached_block_hash_to_block


def test_allocate_returns_none_when_full_and_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    big = make_request("big", list(range(12)))
    assert admit(manager, big) is not None
    small = make_request("small", [50, 51, 52, 53, 54])  # needs 2 blocks, 1 free
    before = (free_ids(manager), dict(manager.req_to_blocks), small.num_computed_tokens)
    assert manager.allocate_slots(small, small.num_tokens) is None
    assert (free_ids(manager), dict(manager.req_to_blocks), small.num_computed_tokens) == before
    assert "small" not in manager.req_to_blocks
    # Decoding into a fresh block works while one is free, then fails.
    big.append_output_token_ids(1)
    assert manager.allocate_slots(big, 1) is not None
    big.num_computed_tokens += 1
    assert manager.allocate_slots(big, 4) is None
    assert manager.num_free_blocks == 0


def test_revived_hits_count_against_free_blocks() -> None:
    """A hit on a free cached block takes it out of the free pool: count it before deciding."""
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    first = make_request("first", prefix + [9])
    admit(manager, first)
    manager.free(first)  # 5 free blocks, two of them cached prefix hits
    assert admit(manager, make_request("other", [70, 71, 72])) is not None  # 4 free
    longer = make_request("longer", prefix + list(range(100, 112)))  # 5 blocks: 2 hits + 3 new
    assert manager.can_fit(longer.num_tokens)
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(longer)
    assert num_hit_tokens == 8
    before = free_ids(manager)
    # 4 free blocks, but 2 of them are the hits: only 2 remain for the 3 new ones.
    assert manager.allocate_slots(longer, longer.num_tokens - 8, 8, hit_blocks) is None
    assert free_ids(manager) == before
    assert all(block.ref_cnt == 0 for block in hit_blocks.blocks)
    assert all(block.block_hash is not None for block in hit_blocks.blocks)


def test_free_order_evicts_tail_first() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(12)))
    admit(manager, request)
    block_ids = manager.get_block_ids("a")
    untouched = [block_id for block_id in range(6) if block_id not in block_ids]
    manager.free(request)
    assert free_ids(manager) == untouched + block_ids[::-1]
    assert manager.get_block_ids("a") == []
    # Reusing blocks takes the never-used ones, then the sequence's tail, keeping its head.
    manager.block_pool.get_new_blocks(len(untouched) + 1)
    again = make_request("again", list(range(12)) + [1])
    assert manager.get_computed_blocks(again)[1] == 8


def test_slots_beyond_the_request_tokens_are_never_cached() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(6)))
    new_blocks = manager.allocate_slots(request, 9)  # three more slots than the request has tokens
    assert new_blocks is not None and len(new_blocks.blocks) == 3  # ceil(9 / 4)
    # Only the full block of the request's own tokens is cached.
    hashes = [block.block_hash is not None for block in manager.get_blocks("a").blocks]
    assert hashes == [True, False, False]


def test_decode_caches_block_when_it_fills() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3])
    admit(manager, request)
    assert manager.get_blocks("a").blocks[0].block_hash is None
    request.append_output_token_ids(4)  # token 3 fills block 0 once computed
    manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    block = manager.get_blocks("a").blocks[0]
    assert block.block_hash == request.block_hashes[0]
    assert manager.block_pool.get_cached_block(block.block_hash) is block


def test_externally_computed_tokens_are_cached_with_the_allocation() -> None:
    """A KV connector's loaded tokens (num_new_computed_tokens without blocks) are indexed at once."""
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("remote", list(range(9)))
    new_blocks = manager.allocate_slots(request, 1, num_new_computed_tokens=8)
    assert new_blocks is not None and len(new_blocks.blocks) == 3
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.cache_blocks(request, 8)  # already indexed: nothing changes
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    with pytest.raises(ValueError, match="num_computed_tokens"):
        manager.cache_blocks(request, 40)


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    admit(manager, request)
    request.append_output_token_ids([11, 12])
    manager.allocate_slots(request, 2)
    request.num_computed_tokens = 12
    held = manager.get_block_ids("a")
    manager.free(request)
    request.num_computed_tokens = 0
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 8  # 12 tokens: block 2 holds the last token, so it is recomputed
    assert hit_blocks.get_block_ids() == held[:2]


def test_parallel_samples_share_prompt_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = list(range(9))
    samples = [make_request(f"a_{index}", prompt) for index in range(3)]
    for sample in samples:
        assert admit(manager, sample) is not None
    shared = manager.get_blocks("a_0").blocks[:2]
    assert [block.ref_cnt for block in shared] == [3, 3]
    assert manager.num_free_blocks == 10 - 2 - 3
    for sample in samples:
        manager.free(sample)
    assert manager.num_free_blocks == 10


def test_reset_prefix_cache() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(9)))
    admit(manager, request)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_prefix_cache_stats() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(9))))
    admit(manager, make_request("b", list(range(9))))
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    # A snapshot: reading again gives the same cumulative counts, and a copy to keep.
    again = manager.make_prefix_cache_stats()
    assert (again.requests, again.queries, again.hits) == (2, 18, 8) and again is not stats
    admit(manager, make_request("c", list(range(9))))
    later = manager.make_prefix_cache_stats()
    assert (later.requests, later.queries, later.hits) == (3, 27, 16)
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)


def test_can_fit_and_usage() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    assert manager.can_fit(16)
    assert not manager.can_fit(17)
    assert manager.num_blocks == 4
    assert manager.usage == 0.0
    admit(manager, make_request("a", list(range(6))))
    assert manager.usage == pytest.approx(0.5)


def test_invalid_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=4)
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(request, -1)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        manager.allocate_slots(request, 1, 0, KVCacheBlocks(manager.block_pool.blocks[:1]))
    assert manager.num_free_blocks == 4
