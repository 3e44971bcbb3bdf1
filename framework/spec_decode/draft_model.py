"""The draft-model proposer: a smaller model with the target's vocabulary guesses the next k tokens.

    LLM(target_dir, speculative_config={"method": "draft_model", "model": draft_dir,
                                        "num_speculative_tokens": 4})

The draft is loaded with Sparrow's own loader (``sparrow.model_loader.load_model``) on the
target's device and in its dtype, its layers bound to the platform's ops, and attends with the
platform's attention backend through metadata built by the model runner's own
``attention_metadata``. It keeps a paged KV cache of its own:

* **Size.** As many blocks as the target's cache, plus ``ceil(k / block_size)`` per request the
  batch can hold (``max_num_seqs``): the draft writes its k - 1 fed drafts past the tokens the
  target has slots for so far. ``kv_cache_bytes_per_block`` adds the draft's bytes per block to
  the target's and ``kv_cache_fixed_bytes`` the extra blocks, so the worker's KV budget holds
  both (the target gets fewer blocks than without a draft).
* **Sharing.** Full blocks of verified tokens are shared between requests and stay cached after
  their requests leave, as in the target's prefix cache (a ``sparrow.core.block_pool.BlockPool``
  of its own, keyed by the target's chained block hashes without the extra keys):
  requests with a common prefix hold one copy of it, and a request coming back (preempted, or
  the same prompt again) starts from the cached blocks. A request that still finds too few
  blocks gets no drafts in that step (nothing else depends on them: the output is unchanged)
  and tries again in the next.
* **Bookkeeping.** Per request: its blocks, how many of its tokens the draft's KV holds
  (``num_computed``), and the drafts it fed after them. Each ``propose`` first keeps the fed
  drafts the target accepted (they match the request's tokens) and drops the rest, so rejected
  drafts' KV is overwritten; then one batched forward catches every row up to its current tokens
  (split by ``max_num_batched_tokens`` when rows arrive with long prompts), its last position's
  argmax is the first draft, and k - 1 batched single-token steps give the others (greedy).
  A request's blocks are released by the first ``propose`` after its row leaves the batch
  (finished, preempted or not scheduled); a request back in the batch catches up from its
  longest cached prefix.

Drafts are point drafts, so the verification (``sparrow.spec_decode.rejection_sampler``) keeps the
target's distribution exactly, greedy or sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sparrow.core.block_pool import BlockPool
from sparrow.core.kv_cache_utils import BlockHash, hash_block_tokens
from sparrow.spec_decode.config import SpeculativeConfig
from sparrow.spec_decode.proposer import ProposerForward, SpecProposer


class PagedDraftCache:
    """A proposer's own paged KV cache: one [2, num_blocks, block_size, heads, head_dim] tensor per
    layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kv_caches: list[torch.Tensor] = []

    @property
    def bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_dim = self.shape
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * num_layers * self.block_size * num_kv_heads * head_dim * element_size

    def allocate(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_dim = self.shape
        self.kv_caches = [torch.zeros(2, num_blocks, self.block_size, num_kv_heads, head_dim, dtype=self.dtype,
                                      device=self.device) for _ in range(num_layers)]

    @property
    def ready(self) -> bool:
        return bool(self.kv_caches)


class DraftStep:
    """Flat inputs of one forward over a proposer's own cache: row i adds ``tokens[i]`` at cache
    indices ``starts[i]..`` (positions ``starts[i] + position_offsets[i]..``)."""

    __slots__ = ("input_ids", "positions", "metadata", "last")

    def __init__(self, runner: Any, block_size: int, tokens: list[np.ndarray], starts: Sequence[int],
                 block_tables: list[list[int]], position_offsets: Sequence[int] | None = None) -> None:
        counts = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
        num_rows = counts.shape[0]
        query_start_loc = np.zeros(num_rows + 1, dtype=np.int32)
        query_start_loc[1:] = np.cumsum(counts)
        rows = np.repeat(np.arange(num_rows), counts)  # [T] row of each token
        starts_arr = np.asarray(starts, dtype=np.int64)
        index = starts_arr[rows] + np.arange(rows.shape[0]) - query_start_loc[:-1].astype(np.int64)[rows]
        width = max(map(len, block_tables))
        table = np.zeros((num_rows, width), dtype=np.int32)
        for i, block_ids in enumerate(block_tables):
            table[i, : len(block_ids)] = block_ids
        slots = table[rows, index // block_size].astype(np.int64) * block_size + index % block_size
        positions = index if position_offsets is None else index + np.asarray(position_offsets, np.int64)[rows]
        seq_lens = (starts_arr + counts).astype(np.int32)
        self.metadata = runner.attention_metadata(query_start_loc, seq_lens, table, slots)
        self.input_ids = runner.to_device(np.concatenate(tokens).astype(np.int64))
        self.positions = runner.to_device(positions)
        self.last = runner.to_device(query_start_loc[1:].astype(np.int64) - 1)  # [rows] each row's last token


def load_draft_model(model_dir: str, runner: Any) -> torch.nn.Module:
    """The draft model of ``model_dir``, built like the target: the worker's load format and
    platform ops, the target's attention backend class, device, dtype and tensor parallelism."""
    from sparrow.model_loader import get_hf_config, load_model
    from sparrow.ops import bind_ops
    from sparrow.quantization import op_overrides_for, resolve_quantization

    hf_config = get_hf_config(model_dir, runner.config.model.trust_remote_code)  # the target's setting
    # The target's hf_overrides describe the target's config.json, not the draft's.
    model_section = runner.config.model.model_copy(
        update={"model": model_dir, "quantization": resolve_quantization(None, hf_config), "hf_overrides": {}})
    config = runner.config.model_copy(update={"model": model_section})
    backend_cls = type(runner.model.attn_backend)
    model = load_model(model_dir, backend_cls, runner.dtype, runner.device, tp=getattr(runner.model, "tp", None),
                       config=config)
    platform = runner.config.device.device
    bind_ops(model, platform, overrides=op_overrides_for(config, platform, hf_config))
    return model


def greedy(model: Any, hidden_states: torch.Tensor, last: torch.Tensor) -> list[int]:
    """The argmax token after each row's last position."""
    return model.compute_logits(hidden_states.index_select(0, last)).argmax(dim=-1).tolist()


class _DraftRequest:
    __slots__ = ("state", "block_ids", "num_computed", "fed", "keys", "root")

    def __init__(self, state: Any) -> None:
        self.state = state  # the runner's CachedRequestState: a resumed request gets a new one
        self.block_ids: list[int] = []
        self.num_computed = 0  # leading tokens of the request whose KV the draft holds
        self.fed: list[int] = []  # drafts fed after them last time (their KV is speculative)
        self.keys: list[BlockHash] = []  # index keys of block_ids[: len(keys)], full of verified tokens
        # The parent of the first block's key: None, or the request's cache_salt hashed, so that
        # only requests with the same salt share the draft's cached blocks (as the scheduler's).
        salt = getattr(state, "cache_salt", None)
        self.root: BlockHash | None = None if salt is None else hash_block_tokens(None, (), ("salt", salt))


class _Plan:
    __slots__ = ("out", "row", "req", "length", "num_decode")

    def __init__(self, out: int, row: int, req: _DraftRequest, length: int, num_decode: int) -> None:
        self.out, self.row, self.req, self.length, self.num_decode = out, row, req, length, num_decode


class DraftModelProposer(SpecProposer):
    def __init__(self, spec_config: SpeculativeConfig, model_runner: Any) -> None:
        super().__init__(spec_config, model_runner)
        from sparrow.model_loader import get_max_model_len
        from sparrow.worker.model_runner import assign_kv_cache_groups

        assert spec_config.model is not None  # parse_speculative_config requires it
        model: Any = load_draft_model(spec_config.model, model_runner)
        self.model = model
        self.max_len = min(model_runner.max_model_len, get_max_model_len(model.config))
        if len(assign_kv_cache_groups(model, self.max_len)) > 1:
            raise ValueError(f"speculative_config.model: {spec_config.model!r} mixes sliding-window and "
                             "full-attention layers, which a draft model's cache does not support")
        self.block_size = model_runner.block_size
        num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
        self.cache = PagedDraftCache(num_layers, num_kv_heads, head_dim, self.block_size, model_runner.dtype,
                                     model_runner.device)
        # A draft block's KV depends only on the token ids up to its end (the draft sees no images,
        # adapters or salts), so the bare chained hash is its key. Sized in initialize_kv_cache.
        self.pool = BlockPool(1)
        # Blocks beyond the target's: each request may hold ceil(k / block_size) more (see Size).
        self.blocks_per_request_ahead = -(-self.num_speculative_tokens // self.block_size)
        self.requests: dict[str, _DraftRequest] = {}
        self.max_num_tokens = model_runner.config.max_num_batched_tokens
        self.num_rows_without_room = 0  # rows that got no drafts for want of draft blocks
        self._forward = ProposerForward(
            "draft model", model, lambda ids, positions, metadata: model.forward(ids, positions, self.cache.kv_caches,
                                                                                  metadata),
            self.cache, self.max_len, -(-self.max_len // self.block_size))

    # -- the cache --------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        return self.cache.bytes_per_block

    def kv_cache_fixed_bytes(self) -> int:
        return self.cache.bytes_per_block * self.model_runner.max_num_reqs * self.blocks_per_request_ahead

    def initialize_kv_cache(self, num_blocks: int) -> None:
        ahead = min(self.model_runner.max_num_reqs, num_blocks) * self.blocks_per_request_ahead
        self.cache.allocate(num_blocks + ahead)
        self.pool = BlockPool(num_blocks + ahead)
        self.requests.clear()

    def graph_forwards(self) -> list[ProposerForward]:
        return [self._forward]

    def _release(self, req_id: str) -> None:
        """Drop a request's holds; its indexed blocks stay cached, its last block evicted first."""
        blocks = self.pool.blocks
        self.pool.free_blocks([blocks[block_id] for block_id in reversed(self.requests.pop(req_id).block_ids)])

    def _grow(self, req: _DraftRequest, num_blocks: int) -> bool:
        """Give ``req`` ``num_blocks`` blocks in all; False when too few are available."""
        missing = num_blocks - len(req.block_ids)
        if missing > self.pool.get_num_free_blocks():
            return False
        if missing > 0:
            req.block_ids.extend(block.block_id for block in self.pool.get_new_blocks(missing))
        return True

    def _adopt_prefix(self, req: _DraftRequest, tokens: np.ndarray, length: int) -> None:
        """Start a new request from the cached blocks of its longest indexed prefix (whole blocks
        before its last token, which is recomputed for its logits)."""
        block_size, keys, blocks, parent = self.block_size, [], [], req.root
        for index in range((length - 1) // block_size):
            parent = hash_block_tokens(parent, tuple(tokens[index * block_size : (index + 1) * block_size].tolist()))
            block = self.pool.get_cached_block(parent)
            if block is None:
                break
            keys.append(parent)
            blocks.append(block)
        self.pool.touch(blocks)
        req.block_ids = [block.block_id for block in blocks]
        req.keys = keys
        req.num_computed = len(keys) * block_size

    def _index_blocks(self, plans: list[_Plan], token_ids: np.ndarray) -> None:
        """Index the blocks the catch-up filled with verified tokens (before each row's last token,
        whose position a later step may write again)."""
        block_size = self.block_size
        for plan in plans:
            req = plan.req
            for index in range(len(req.keys), min(req.num_computed, plan.length - 1) // block_size):
                block_tokens = token_ids[plan.row, index * block_size : (index + 1) * block_size].tolist()
                key = hash_block_tokens(req.keys[-1] if req.keys else req.root, tuple(block_tokens))
                self.pool.cache_block(self.pool.blocks[req.block_ids[index]], key)
                req.keys.append(key)

    # -- proposing --------------------------------------------------------------------------
    def propose(self, rows: Sequence[int], token_ids: np.ndarray, num_tokens: np.ndarray,
                hidden_states: Any = None) -> list[list[int]]:
        runner = self.model_runner
        batch = runner.batch
        if not self.cache.ready:  # a runner that never sized its cache: as many blocks as the target's
            self.initialize_kv_cache(runner.kv_caches[0].shape[1])
        for req_id, req in list(self.requests.items()):
            row = batch.req_id_to_row.get(req_id)
            if row is None or batch.states[row] is not req.state:
                self._release(req_id)  # finished, preempted or unscheduled: its row left the batch
        out: list[list[int]] = [[] for _ in rows]
        plans = self._plan(rows, token_ids, num_tokens)
        if not plans:
            return out
        for plan, token in zip(plans, self._catch_up(plans, token_ids)):
            out[plan.out].append(token)
        self._index_blocks(plans, token_ids)
        self._decode(plans, out)
        return out

    def _plan(self, rows: Sequence[int], token_ids: np.ndarray, num_tokens: np.ndarray) -> list[_Plan]:
        batch, k, block_size = self.model_runner.batch, self.num_speculative_tokens, self.block_size
        plans: list[_Plan] = []
        for out, row in enumerate(rows):
            state = batch.states[row]
            length = int(num_tokens[row])
            if length >= self.max_len:
                continue  # no position left for a draft
            req = self.requests.get(state.req_id)
            if req is None:
                req = self.requests[state.req_id] = _DraftRequest(state)
                self._adopt_prefix(req, token_ids[row], length)
            elif req.fed:
                # Keep the KV of the fed drafts that became the request's tokens; the rest is overwritten.
                start = req.num_computed
                stop = min(start + len(req.fed), length)
                matches = token_ids[row, start:stop] == np.asarray(req.fed[: stop - start])
                req.num_computed = start + int(np.argmin(matches) if not matches.all() else matches.shape[0])
            req.num_computed = min(req.num_computed, length - 1)  # at least one token to read logits from
            req.fed = []
            num_decode = min(k - 1, self.max_len - length)  # draft j is fed at position length + j - 1
            last_index = length - 1 + num_decode
            if not self._grow(req, last_index // block_size + 1):
                self._release(state.req_id)
                self.num_rows_without_room += 1
                continue
            plans.append(_Plan(out, row, req, length, num_decode))
        return plans

    def _catch_up(self, plans: list[_Plan], token_ids: np.ndarray) -> list[int]:
        """Compute every planned row's tokens since ``num_computed`` (rows in slices of at most
        ``max_num_tokens`` tokens per forward); returns each row's first draft."""
        first = [0] * len(plans)
        pending = list(range(len(plans)))
        while pending:
            budget = max(self.max_num_tokens, 1)
            chosen: list[tuple[int, int]] = []  # (plan index, stop)
            for index in pending:
                if budget <= 0:
                    break
                req = plans[index].req
                stop = min(plans[index].length, req.num_computed + budget)
                chosen.append((index, stop))
                budget -= stop - req.num_computed
            reqs = [plans[i].req for i, _ in chosen]
            step = DraftStep(self.model_runner, self.block_size,
                             [token_ids[plans[i].row, req.num_computed : stop] for (i, stop), req in zip(chosen, reqs)],
                             [req.num_computed for req in reqs], [req.block_ids for req in reqs])
            tokens = greedy(self.model, self._forward(step), step.last)
            for (index, stop), token in zip(chosen, tokens):
                plans[index].req.num_computed = stop
                if stop == plans[index].length:
                    first[index] = token
            pending = [index for index in pending if plans[index].req.num_computed < plans[index].length]
        return first

    def _decode(self, plans: list[_Plan], out: list[list[int]]) -> None:
        """k - 1 single-token steps: each row feeds its last draft and reads the next."""
        for j in range(1, self.num_speculative_tokens):
            active = [plan for plan in plans if plan.num_decode >= j]
            if not active:
                return
            fed = [out[plan.out][-1] for plan in active]
            step = DraftStep(self.model_runner, self.block_size, [np.array([token]) for token in fed],
                             [plan.length + j - 1 for plan in active], [plan.req.block_ids for plan in active])
            for plan, token, drafted in zip(active, fed, greedy(self.model, self._forward(step), step.last)):
                plan.req.fed.append(token)
                out[plan.out].append(drafted)
