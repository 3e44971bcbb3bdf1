"""The persistent batch: per-request rows of token ids and block tables, kept across steps.

Rows change only when requests join, leave, or are not scheduled in a step; each step then
reads its inputs from these arrays with vectorised numpy indexing instead of rebuilding them from
Python lists. Removing a row moves the last row into the hole, so rows stay dense; a request that
joins is appended. ``take_batch_update`` reports the net change since its previous call to the
logits processors (``sparrow.sample.logits_processor.interface``).

Every change to a row's block tables (a request added or moved into the row, blocks appended)
gives the row a new ``row_version``, so a device copy of the tables (``sparrow.worker.input_buffers``)
copies only the rows whose version it has not seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparrow.sample.logits_processor.interface import AddedRequest, BatchUpdate
from sparrow.sample.logits_processor.state import layout_update
from sparrow.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What a worker remembers about a request while it is unfinished (scheduled or not)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Hybrid KV cache: block ids of KV cache groups 1.., one list each (``block_ids``: group 0's).
    extra_group_block_ids: list[list[int]] = field(default_factory=list)
    # The request's LoRA adapter (sparrow.lora.request.LoRARequest), or None for the base model.
    lora_request: Any = None
    # vLLM's cache_salt (None: none), which keys a draft model's prefix cache as the scheduler's.
    cache_salt: str | None = None
    # vLLM's prompt embeddings: a CPU tensor [num_prompt_tokens, hidden] in the model's dtype, read
    # in place of the token embeddings; prompt_token_ids then hold placeholders (0). None: none.
    prompt_embeds: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def sampling_prompt_token_ids(self) -> list[int]:
        """The prompt the penalties and logits processors see: none for a prompt given as
        embeddings (its placeholder ids are not tokens the request contains)."""
        return self.prompt_token_ids if self.prompt_embeds is None else []


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # [max_num_reqs, max_model_len]: prompt then output token ids of the request in each row
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # [max_num_reqs, max_num_blocks_per_req]: physical block ids, 0 past num_blocks
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Hybrid KV cache: KV cache groups 1.. have tables of their own, shaped like block_table
        # (which is group 0's).
        self.extra_block_tables = [np.zeros_like(self.block_table) for _ in range(num_kv_cache_groups - 1)]
        self.extra_num_blocks = [np.zeros_like(self.num_blocks) for _ in range(num_kv_cache_groups - 1)]
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Per row: a number unique to the row's current block tables (0: never written). Drawn
        # from one counter, so a row emptied and refilled never repeats a version a copy has seen.
        self.row_version = np.zeros(max_num_reqs, dtype=np.int64)
        self._last_row_version = 0
        self.req_ids: list[str] = []  # row -> req_id
        self.req_id_to_row: dict[str, int] = {}
        self.states: list[CachedRequestState] = []  # row -> state
        # Bumped whenever rows change, so the sampling tensors know to rebuild.
        self.version = 0
        self._reported_states: list[CachedRequestState] = []  # the layout take_batch_update last saw

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, state: CachedRequestState) -> int:
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        tokens = state.prompt_token_ids + state.output_token_ids
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has {len(tokens)} tokens > max_model_len {self.max_model_len}")
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.block_table[row, : len(state.block_ids)] = state.block_ids
        self.num_blocks[row] = len(state.block_ids)
        if len(state.extra_group_block_ids) != len(self.extra_block_tables):
            raise ValueError(f"request {state.req_id!r} has block ids for {1 + len(state.extra_group_block_ids)} "
                             f"KV cache groups, the batch has {1 + len(self.extra_block_tables)}")
        for table, num_blocks, block_ids in zip(self.extra_block_tables, self.extra_num_blocks,
                                                state.extra_group_block_ids):
            table[row, : len(block_ids)] = block_ids
            num_blocks[row] = len(block_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self._tables_changed(row)
        self.req_ids.append(state.req_id)
        self.req_id_to_row[state.req_id] = row
        self.states.append(state)
        self.version += 1
        return row

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            self._move(last, row)
        self.req_ids.pop()
        self.states.pop()
        self.version += 1

    def _move(self, src: int, dst: int) -> None:
        n_tok, n_blk = int(self.num_tokens[src]), int(self.num_blocks[src])
        self.token_ids[dst, :n_tok] = self.token_ids[src, :n_tok]
        self.num_tokens[dst] = n_tok
        self.block_table[dst, :n_blk] = self.block_table[src, :n_blk]
        self.num_blocks[dst] = n_blk
        for table, num_blocks in zip(self.extra_block_tables, self.extra_num_blocks):
            n_blk = int(num_blocks[src])
            table[dst, :n_blk] = table[src, :n_blk]
            num_blocks[dst] = n_blk
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self._tables_changed(dst)
        self.req_ids[dst] = self.req_ids[src]
        self.states[dst] = self.states[src]
        self.req_id_to_row[self.req_ids[dst]] = dst

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)
        self._tables_changed(row)

    def append_extra_group_blocks(self, row: int, extra_group_block_ids: list[list[int]]) -> None:
        """Hybrid KV cache: append blocks to the row's tables of groups 1.., one list each."""
        changed = False
        for table, num_blocks, block_ids in zip(self.extra_block_tables, self.extra_num_blocks,
                                                extra_group_block_ids):
            if not block_ids:
                continue
            start = int(num_blocks[row])
            table[row, start : start + len(block_ids)] = block_ids
            num_blocks[row] = start + len(block_ids)
            changed = True
        if changed:
            self._tables_changed(row)

    def _tables_changed(self, row: int) -> None:
        self._last_row_version += 1
        self.row_version[row] = self._last_row_version

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        if n < self.max_model_len:
            self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def take_batch_update(self) -> BatchUpdate | None:
        """The rows' net change since the previous call (None if none). A state object is a
        request's identity: a request resumed after preemption has a new one, so it is reported
        as added, with the tokens it had generated."""
        update = layout_update(self._reported_states, self.states, _describe_added)
        self._reported_states = list(self.states)
        return update


def _describe_added(row: int, state: CachedRequestState) -> AddedRequest:
    return (row, state.sampling_params, state.sampling_prompt_token_ids, state.output_token_ids)
