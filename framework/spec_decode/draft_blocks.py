"""The draft model's blocks: reference counts and a prefix index, as the target's cache has.

A draft model's KV for a block depends only on the token ids up to the block's end (the draft
sees no images, adapters or salts), so full blocks of tokens the target verified are shared
between requests and kept after their requests leave, keyed by a hash chained over the blocks
before them. Without this, requests that share a prompt prefix (one system prompt, ``n > 1``)
hold one block in the target's cache but one copy each in the draft's, and the draft's cache,
sized like the target's, runs out first: the last requests in the batch then go without drafts.

A block is in one of three places: held (``refs``: by how many requests), cached (held by none,
still indexed, evicted least recently released first) or free (``cache.free``, no content).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sparrow.spec_decode.draft_model import PagedDraftCache

_ROOT = hashlib.blake2b(b"sparrow/draft-cache/root", digest_size=16).digest()


def chain_key(parent: bytes | None, block_token_ids: np.ndarray) -> bytes:
    """The index key of a full block: its tokens, chained to the key of the block before it."""
    payload = np.ascontiguousarray(block_token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b((parent or _ROOT) + payload, digest_size=16).digest()


class DraftBlockPool:
    """Hands out ``cache``'s blocks (``cache.free``), sharing full blocks through their keys."""

    def __init__(self, cache: PagedDraftCache) -> None:
        self.cache = cache
        self.refs: dict[int, int] = {}  # held block -> holders
        self.cached: OrderedDict[int, None] = OrderedDict()  # held by none, indexed; oldest first
        self.index: dict[bytes, int] = {}  # key -> block
        self.key_of: dict[int, bytes] = {}  # indexed block -> key

    def num_available(self) -> int:
        return len(self.cache.free) + len(self.cached)

    def take(self) -> int:
        """A block with no content for one holder; the oldest cached one when none is free."""
        if self.cache.free:
            block = self.cache.free.pop()
        else:
            block, _ = self.cached.popitem(last=False)
            del self.index[self.key_of.pop(block)]
        self.refs[block] = 1
        return block

    def match(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest indexed prefix of ``keys``, each now held once more."""
        blocks: list[int] = []
        for key in keys:
            block = self.index.get(key)
            if block is None:
                break
            if block in self.cached:
                del self.cached[block]
            self.refs[block] = self.refs.get(block, 0) + 1
            blocks.append(block)
        return blocks

    def register(self, block: int, key: bytes) -> None:
        """Index a held block now full of verified tokens (a block already indexed under the same
        key keeps the entry; this one is freed with its holder)."""
        if key not in self.index and block not in self.key_of:
            self.index[key] = block
            self.key_of[block] = key

    def release(self, blocks: list[int]) -> None:
        """One holder lets go of ``blocks``: unheld indexed blocks stay cached, the others are freed."""
        for block in reversed(blocks):
            count = self.refs[block] - 1
            if count:
                self.refs[block] = count
                continue
            del self.refs[block]
            if block in self.key_of:
                self.cached[block] = None
            else:
                self.cache.free.append(block)

    def reset(self) -> None:
        """Forget every block (the cache was reallocated)."""
        self.refs.clear()
        self.cached.clear()
        self.index.clear()
        self.key_of.clear()
