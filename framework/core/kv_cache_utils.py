"""KV-cache building blocks: block hashes, blocks, the free-block queue, prefix-cache stats.

Pure Python (no torch, no numpy): the scheduler's memory bookkeeping runs on the hot path of
the engine core and must stay cheap to import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

import msgspec

from sparrow.core.eviction import EvictionPolicy, LRUPolicy

if TYPE_CHECKING:
    from sparrow.core.request import Request

# A sha256 digest (32 bytes). Bytes rather than Python's hash() because a KV connector keys
# files by it, so it must be identical in every process and on every machine.
BlockHash = NewType("BlockHash", bytes)

# The parent of a sequence's first block. A fixed value (not a random seed) keeps hashes stable
# across processes and restarts.
ROOT_PARENT_BLOCK_HASH = BlockHash(hashlib.sha256(b"sparrow/kv-cache/root-block").digest())


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    block_token_ids: tuple[int, ...],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block, chained to its parent so that a block's hash names its whole prefix.

    Two blocks with the same tokens but different earlier context get different hashes, which
    is what makes ``hash -> block`` a valid prefix-cache index. ``extra_keys`` carries anything
    else the KV depends on (a LoRA name, a cache salt, multimodal hashes); it must be
    msgpack-encodable (ints, strings, bytes, tuples, ...).
    """
    parent = ROOT_PARENT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    try:
        # msgpack is a canonical encoding for these types: the same value gives the same bytes
        # everywhere, unlike pickle whose output may vary between Python versions.
        payload = msgspec.msgpack.encode((parent, block_token_ids, extra_keys))
    except TypeError as exc:
        raise TypeError(
            f"hash_block_tokens: block_token_ids and extra_keys must be msgpack-encodable: {exc}"
        ) from exc
    return BlockHash(hashlib.sha256(payload).digest())


def group_block_hash(block_hash: BlockHash, kv_cache_group_id: int) -> BlockHash:
    """The prefix-cache key of a block of KV cache group ``kv_cache_group_id``.

    Every group of a hybrid cache holds the same tokens in its own blocks, so the key must name
    the group too; group 0 keeps the bare hash (what a single-group cache and a KV connector use).
    """
    if kv_cache_group_id == 0:
        return block_hash
    return BlockHash(block_hash + kv_cache_group_id.to_bytes(2, "little"))


def update_request_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of ``request.all_token_ids``.

    Incremental: only blocks that became full since the last call are hashed, so calling it
    after every appended token costs one hash per ``block_size`` tokens. Returns the hashes.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    block_hashes: list[BlockHash] = request.block_hashes
    token_ids = request.all_token_ids
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    extra_keys = request_extra_keys(request)
    embeds = getattr(request, "prompt_embeds", None)
    for block_index in range(len(block_hashes), num_full_blocks):
        start = block_index * block_size
        keys = extra_keys
        if embeds is not None and start < embeds.shape[0]:  # placeholder ids: the block's embeddings key it
            keys = (keys or ()) + prompt_embeds_key(embeds, start, start + block_size)
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]), keys)
        block_hashes.append(parent)
    return block_hashes


def prompt_embeds_key(embeds: Any, start: int, stop: int) -> tuple[Any, ...]:
    """The part of a block's hash that its prompt embeddings (rows ``start:stop`` of a
    sparrow.wire.TensorData [num_tokens, hidden]) make: their dtype and bytes, so that a block is
    shared only by requests that gave the same embeddings at the same positions."""
    row_bytes = len(embeds.data) // embeds.shape[0]
    return ("embeds", embeds.dtype, embeds.data[start * row_bytes:min(stop, embeds.shape[0]) * row_bytes])


def request_extra_keys(request: Request) -> tuple[Any, ...] | None:
    """What besides the tokens keys a request's blocks: its LoRA adapter (name and id), so that a
    request never reuses blocks computed under another adapter or without one, and its
    ``cache_salt``, so that only requests with the same salt share blocks (vLLM's)."""
    keys: tuple[Any, ...] = ()
    lora_request = getattr(request, "lora_request", None)
    if lora_request is not None:
        keys += ("lora", lora_request.lora_name, lora_request.lora_int_id)
    salt = getattr(request, "cache_salt", None)
    if salt is not None:
        keys += ("salt", salt)
    return keys or None


@dataclass(slots=True, frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table: same attention kind, same window.

    ``sliding_window`` W (None: full attention) means a token at position p reads only the keys at
    p - W + 1 .. p, so a request needs only its last W tokens' blocks in this group.
    """

    sliding_window: int | None
    layer_indices: tuple[int, ...]


def make_kv_cache_groups(layer_windows: Sequence[int | None], max_model_len: int | None = None,
                         ) -> list[KVCacheGroupSpec]:
    """Split the layers (``layer_windows[i]``: layer i's window, None for full attention) into
    KV cache groups of equal size, full attention first, then windows in increasing size.

    One kind of layer makes one group (a plain model; or Mistral, every layer sliding). Several
    kinds (Gemma 2/3 interleave sliding and global layers) make groups of ``min(count per kind)``
    layers each, so that layer j of every group can share one physical cache tensor: the groups
    hand out disjoint block ids of one pool, and a pool block costs one group's layers. A window
    that covers ``max_model_len`` is full attention. (The idea is vLLM V1's hybrid KV cache.)
    """
    by_window: dict[int | None, list[int]] = {}
    for layer_index, window in enumerate(layer_windows):
        if window is not None and max_model_len is not None and window >= max_model_len:
            window = None
        by_window.setdefault(window, []).append(layer_index)
    if not by_window:
        raise ValueError("make_kv_cache_groups needs at least one layer")
    kinds = sorted(by_window, key=lambda window: -1 if window is None else window)
    group_size = min(len(layers) for layers in by_window.values())
    return [
        KVCacheGroupSpec(window, tuple(layers[start:start + group_size]))
        for window in kinds
        for layers in (by_window[window],)
        for start in range(0, len(layers), group_size)
    ]


def request_capacity_tokens(num_blocks: int, block_size: int, hf_config: Any, max_model_len: int) -> int:
    """The most tokens the frontend lets one request ask for (its cheap check before sending).

    ``num_blocks * block_size`` slots, unless every layer attends through a window shorter than
    ``max_model_len``: such a request holds about its window only, and the engine core's
    ``KVCacheManager.can_fit`` decides.
    """
    from sparrow.models.windows import attended_windows

    windows = attended_windows(hf_config) if hf_config is not None else []
    if windows and all(window is not None and window < max_model_len for window in windows):
        return max_model_len
    return num_blocks * block_size


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of KV-cache slots. Identity matters, not value, hence ``eq=False``."""

    block_id: int
    # How many requests hold this block; 0 means it sits in the free queue.
    ref_cnt: int = 0
    # Set once the block is full and indexed in the prefix cache; cleared on eviction.
    block_hash: BlockHash | None = None
    # Links of FreeKVCacheBlockQueue; only meaningful while the block is free.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The tier of FreeKVCacheBlockQueue holding the block; None while it is not free.
    free_tier: EvictionPolicy | None = None

    def __repr__(self) -> str:
        # The default repr would follow the free-list links through every free block.
        block_hash = None if self.block_hash is None else self.block_hash.hex()[:12]
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={block_hash})"


class FreeKVCacheBlockQueue:
    """Every free block, in the order they are handed out (which evicts their cached content).

    Two tiers: blocks without cached content (no ``block_hash``: never filled, or reset) come
    first, in the order they were freed, since reusing them evicts nothing; then the cached ones,
    in the order the eviction ``policy`` picks (default ``LRUPolicy``: least recently freed
    first). Every operation is O(1) plus the policy's cost; removing a block from the middle
    (a prefix-cache hit on a free block) included.

    A block's tier is decided when it joins the queue: the pool only sets or clears hashes of
    blocks that are not in it (``reset_prefix_cache`` rebuilds the queue).
    """

    __slots__ = ("_uncached", "_cached", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock] = (), policy: EvictionPolicy | None = None) -> None:
        self._uncached = LRUPolicy()
        self._cached: EvictionPolicy = LRUPolicy() if policy is None else policy
        self.num_free_blocks = 0
        self.append_n(blocks)

    @property
    def policy(self) -> EvictionPolicy:
        return self._cached

    def __len__(self) -> int:
        return self.num_free_blocks

    def contains(self, block: KVCacheBlock) -> bool:
        tier = block.free_tier
        return tier is not None and (tier is self._uncached or tier is self._cached)

    def popleft(self) -> KVCacheBlock:
        uncached = self._uncached
        if uncached._num_blocks:  # len(uncached) without the call: allocation is on the hot path
            block = uncached.pop()
        elif self.num_free_blocks:
            block = self._cached.pop()
            if block.free_tier is not self._cached:
                raise RuntimeError(f"eviction policy {type(self._cached).__name__} popped {block!r}, "
                                   "which it does not hold")
        else:
            raise ValueError("FreeKVCacheBlockQueue.popleft: no free blocks")
        block.free_tier = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        if not 0 <= num_blocks <= self.num_free_blocks:
            raise ValueError(
                f"num_blocks must be in [0, {self.num_free_blocks}] (free blocks), got {num_blocks}"
            )
        return [self.popleft() for _ in range(num_blocks)]

    def remove(self, block: KVCacheBlock) -> None:
        tier = block.free_tier
        if tier is None or not (tier is self._uncached or tier is self._cached):
            raise ValueError(f"{block!r} is not in the free queue")
        tier.remove(block)
        block.free_tier = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.free_tier is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        tier = self._uncached if block.block_hash is None else self._cached
        tier.push(block)
        block.free_tier = tier
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, next to be reused first. O(n) or more: for tests and debugging."""
        return self._uncached.blocks_in_order() + self._cached.blocks_in_order()


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters, cumulative; ``hits / queries`` is the token hit rate."""

    # Requests looked up in the prefix cache.
    requests: int = 0
    # Tokens looked up (the requests' num_tokens).
    queries: int = 0
    # Tokens found cached.
    hits: int = 0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
