"""Persistent step inputs: host buffers filled in place every step, and their device copies.

A step's flat inputs (input ids, positions, slot mappings, query start locations, sequence
lengths, logits indices) are written into buffers allocated once, with numpy ``out=`` operations,
instead of arrays built anew each step. The persistent batch's block tables get one device tensor
per KV cache group, updated incrementally.

Host and device
  * CPU (the default there): a device tensor *is* its host buffer, a zero-copy view.
  * CUDA, or ``separate_device=True`` (tests use it on CPU to exercise the copying path): the host
    buffer is pinned and the step's used bytes go to a device buffer in ONE non-blocking copy. The
    per-token int64 inputs and the per-row int32 ones share that buffer, packed end to end.

Reuse across steps
  Two sets of step buffers alternate, so a step's tensors (its host views and device tensors)
  stay valid until the step after next prepares its inputs: nobody may keep them longer. A
  non-blocking copy reads its pinned source when the GPU gets to it, not when it is enqueued, so a
  set's host buffer must not be refilled before every copy from it ran (ours, and a backend's
  from the host views: FlashInfer plans from ``query_start_loc_cpu``). When step n+1 begins
  preparing, all of step n's work has been enqueued: an event recorded on the current stream then
  is waited on before step n's set is refilled at step n+2. In a synchronous step loop the step's
  own sync (the sampled tokens come to the host) has long passed that event, so the wait costs
  nothing; with overlapped scheduling, where step n+1 is prepared while step n runs, it is what
  keeps the alternate set safe. (Work on another stream than the current one is not covered.)

Block tables
  InputBatch gives a row a new ``row_version`` whenever its tables change (a request added or
  moved into the row, blocks appended). Only rows whose version the device table has not seen are
  copied: gathered into the step's pinned buffer (the host table may change again before the copy
  runs), copied with the rest, then scattered into the device table with ``index_copy_``. There is
  one device table per group, not one per set: its updates are enqueued on the same stream after
  the previous step's kernels, which therefore read the rows they were launched with. The
  returned table is ``[num_reqs, max_num_blocks_per_req]``, a contiguous view of the first rows;
  columns past a row's blocks hold stale ids (as the host table does), never read within seq_lens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Initial room, in int64 words, for the changed block-table rows of a step (grown on demand).
_INITIAL_TABLE_WORDS = 1 << 14
# Step shapes whose views a set keeps (cleared when full: views are cheap to make again).
_MAX_CACHED_SHAPES = 256


@dataclass(slots=True)
class PreparedStep:
    """One step's inputs: device tensors and their host views (valid for this step and the next)."""

    num_tokens: int  # real tokens
    num_padded: int  # tokens after padding (the device inputs' length)
    num_reqs: int
    input_ids: torch.Tensor  # [num_padded] int64
    positions: torch.Tensor  # [num_padded] int64
    slot_mappings: list[torch.Tensor]  # per KV cache group: [num_padded] int64, -1 for padding
    block_tables: list[torch.Tensor]  # per KV cache group: [num_reqs, max_num_blocks_per_req] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    logits_indices: torch.Tensor  # [num_reqs] int64
    query_start_loc_cpu: torch.Tensor  # host views of the two above
    seq_lens_cpu: torch.Tensor
    complete_rows: np.ndarray  # [num_reqs] bool: the row samples a token this step
    max_query_len: int
    max_seq_len: int


class _StepSet:
    """One of the two alternating sets: a packed host buffer, its device twin, host scratch."""

    def __init__(self, owner: InputBuffers, num_words: int) -> None:
        self.host = owner.host_tensor(num_words)
        self.host_np = self.host.numpy()
        self.device = self.host if not owner.separate_device else torch.zeros(
            num_words, dtype=torch.int64, device=owner.device)
        # Recorded when the next step begins (after all work of this set's step was enqueued),
        # waited on before the set is refilled (CUDA only).
        self.event: Any = torch.cuda.Event() if owner.separate_device and owner.device.type == "cuda" else None
        self.copy_pending = False
        n, r = owner.max_num_tokens, owner.max_num_reqs
        # Host-only scratch, never copied: token -> row, flat indices, block columns and offsets.
        self.rows = np.zeros(n, dtype=np.int64)
        self.flat = np.zeros(n, dtype=np.int64)
        self.column = np.zeros(n, dtype=np.int64)
        self.offset = np.zeros(n, dtype=np.int64)
        self.block = np.zeros(n, dtype=np.int32)
        self.row_base = np.zeros(r, dtype=np.int64)
        self.complete = np.zeros(r, dtype=bool)
        # (padded tokens, rows) -> _Views: a step shape repeats for many steps (decodes of one
        # batch), and slicing tensors costs more host time than filling them.
        self.views: dict[tuple[int, int], _Views] = {}

    def wait_for_copy(self) -> None:
        if self.copy_pending:
            self.event.synchronize()
            self.copy_pending = False

    def views_for(self, owner: InputBuffers, num_padded: int, num_reqs: int) -> _Views:
        views = self.views.get((num_padded, num_reqs))
        if views is None:
            if len(self.views) >= _MAX_CACHED_SHAPES:
                self.views.clear()
            views = self.views[(num_padded, num_reqs)] = _Views(self, owner, num_padded, num_reqs)
        return views


class _Views:
    """A set's packed buffer laid out for one step shape (P tokens, R rows), in int64 words:
    input ids [P] | positions [P] | a slot mapping [P] per KV cache group | logits indices [R] |
    int32 query_start_loc [R + 1] and seq_lens [R] (in R + 1 words) | then, when block-table
    rows changed, their row indices [C] and entries (int32 [groups, C, width]). The numpy views
    are filled; the tensors are what the step returns."""

    __slots__ = ("ids", "positions", "slots", "logits", "query_start_loc", "seq_lens", "complete", "fixed_end",
                 "tensors", "copy_pair")

    def __init__(self, step_set: _StepSet, owner: InputBuffers, P: int, R: int) -> None:
        host_np, host, device = step_set.host_np, step_set.host, step_set.device
        groups = owner.num_groups
        at = (2 + groups) * P
        int32 = slice(at + R, at + 2 * R + 1)
        self.fixed_end = int32.stop
        self.ids, self.positions = host_np[0:P], host_np[P:2 * P]
        self.slots = [host_np[(2 + g) * P:(3 + g) * P] for g in range(groups)]
        self.logits = host_np[at:at + R]
        as_int32 = host_np[int32].view(np.int32)
        self.query_start_loc, self.seq_lens = as_int32[:R + 1], as_int32[R + 1:2 * R + 1]
        self.complete = step_set.complete[:R]
        with torch.inference_mode(False):
            device_int32, host_int32 = device[int32].view(torch.int32), host[int32].view(torch.int32)
            # input_ids, positions, slot mappings, block tables, query_start_loc, seq_lens, logits
            # indices, and the host copies of query_start_loc and seq_lens
            self.tensors = (device[0:P], device[P:2 * P], [device[(2 + g) * P:(3 + g) * P] for g in range(groups)],
                            [table[:R] for table in owner.device_tables], device_int32[:R + 1],
                            device_int32[R + 1:2 * R + 1], device[at:at + R], host_int32[:R + 1],
                            host_int32[R + 1:2 * R + 1])
            self.copy_pair = (device[:self.fixed_end], host[:self.fixed_end])


class InputBuffers:
    """The runner's persistent step inputs (see the module docstring)."""

    def __init__(self, batch: Any, max_num_tokens: int, block_size: int, device: torch.device,
                 separate_device: bool | None = None, pin_memory: bool | None = None) -> None:
        self.batch = batch
        self.block_size = block_size
        self.device = device
        self.separate_device = device.type != "cpu" if separate_device is None else separate_device
        self.pin_memory = (self.separate_device and device.type == "cuda") if pin_memory is None else pin_memory
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = batch.max_num_reqs
        self.host_tables = [batch.block_table, *batch.extra_block_tables]
        self.num_blocks = [batch.num_blocks, *batch.extra_num_blocks]
        self.num_groups = len(self.host_tables)
        self.width = self.host_tables[0].shape[1]
        # Normal tensors even when made under inference mode (the runner's step), so that the
        # in-place copies into them work in and out of it.
        with torch.inference_mode(False):
            if self.separate_device:
                self.device_tables = [torch.zeros(t.shape, dtype=torch.int32, device=device)
                                      for t in self.host_tables]
            else:
                self.device_tables = [torch.from_numpy(t) for t in self.host_tables]  # the host tables themselves
        # The row_version of each row the device tables hold (-1: none yet).
        self.synced_version = np.full(self.max_num_reqs, -1, dtype=np.int64)
        # Row r's first element in the flattened token_ids and block tables.
        rows = np.arange(self.max_num_reqs, dtype=np.int64)
        self.row_token_start = rows * batch.token_ids.shape[1]
        self.row_table_start = rows * self.width
        self._allocate_sets()
        self.step_index = 0

    def host_tensor(self, num_words: int) -> torch.Tensor:
        return torch.zeros(num_words, dtype=torch.int64, pin_memory=self.pin_memory)

    def _allocate_sets(self, table_words: int = _INITIAL_TABLE_WORDS) -> None:
        self.arange = np.arange(max(self.max_num_tokens, self.max_num_reqs), dtype=np.int64)
        words = (3 + self.num_groups) * self.max_num_tokens + 2 * self.max_num_reqs + 1 + table_words
        with torch.inference_mode(False):
            self.sets = [_StepSet(self, words) for _ in range(2)]

    def _make_room(self, num_padded: int, words: int) -> None:
        """Grow both sets (rare: a step past the configured token budget, or many long table
        rows changing at once); waits for their copies first."""
        for step_set in self.sets:
            step_set.wait_for_copy()
        self.max_num_tokens = max(num_padded, self.max_num_tokens)
        self._allocate_sets(max(_INITIAL_TABLE_WORDS, 2 * words))

    # -- the step ------------------------------------------------------------------------------
    def prepare(self, num_scheduled: np.ndarray, num_padded: int) -> PreparedStep:
        """Fill a step's buffers from the persistent batch and start their copy. ``num_scheduled``:
        [num_reqs] int64, the new tokens of each row (each >= 1: an unscheduled request has no
        row); ``num_padded``: the step's token count after padding."""
        num_reqs = self.batch.num_reqs
        if num_reqs == 0 or int(num_scheduled.min()) < 1:
            raise RuntimeError(f"every row of the step needs a scheduled token: {num_scheduled.tolist()}")
        changed, width = self._changed_rows(num_reqs)
        table_words = changed.shape[0] + (self.num_groups * changed.shape[0] * width + 1) // 2
        self._step_enqueued()
        step_set = self.sets[self.step_index % 2]
        if num_padded > self.max_num_tokens or \
                (3 + self.num_groups) * num_padded + 2 * num_reqs + 1 + table_words > step_set.host_np.shape[0]:
            self._make_room(num_padded, table_words)
            step_set = self.sets[self.step_index % 2]
        self.step_index += 1
        step_set.wait_for_copy()  # its previous step's reads are done before the buffer changes
        views = step_set.views_for(self, num_padded, num_reqs)
        total = self._fill(step_set, views, num_scheduled)
        end = views.fixed_end
        if changed.shape[0]:
            end = self._pack_table_rows(step_set.host_np, views.fixed_end, changed, width)
        if self.separate_device:
            self._copy(step_set, views, end, changed.shape[0], width)
        if changed.shape[0]:
            self.synced_version[changed] = self.batch.row_version[changed]
        t = views.tensors
        return PreparedStep(
            num_tokens=total, num_padded=num_padded, num_reqs=num_reqs, input_ids=t[0], positions=t[1],
            slot_mappings=t[2], block_tables=t[3], query_start_loc=t[4], seq_lens=t[5], logits_indices=t[6],
            query_start_loc_cpu=t[7], seq_lens_cpu=t[8], complete_rows=views.complete,
            max_query_len=1 if total == num_reqs else int(num_scheduled.max()), max_seq_len=int(views.seq_lens.max()),
        )

    def _step_enqueued(self) -> None:
        """Mark the end of the previous step's work on the stream: everything it enqueued that
        reads its set (our copy, and copies a backend makes from the host views, such as
        FlashInfer's plan from query_start_loc_cpu) precedes this point."""
        if self.step_index == 0:
            return
        previous = self.sets[(self.step_index - 1) % 2]
        if previous.event is not None:
            previous.event.record()
            previous.copy_pending = True

    def _fill(self, step_set: _StepSet, views: _Views, num_scheduled: np.ndarray) -> int:
        """The host half: every per-token and per-row input, written in place."""
        batch, block_size = self.batch, self.block_size
        R = num_scheduled.shape[0]
        query_start_loc = views.query_start_loc
        query_start_loc[0] = 0
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[R])
        num_computed = batch.num_computed_tokens[:R]
        pos = views.positions[:total]
        token_index, table_index = step_set.flat[:total], step_set.rows[:total]
        if total == R:  # a pure decode step: token i is row i's, at its next position
            np.copyto(pos, num_computed)
            np.add(self.row_token_start[:R], pos, out=token_index)
            row_table_start = self.row_table_start[:R]
        else:
            rows = step_set.rows[:total]  # token -> row: a 1 at each row's first token, summed
            rows.fill(0)
            rows[query_start_loc[1:R]] = 1
            np.cumsum(rows, out=rows)
            row_base = step_set.row_base[:R]  # position = num_computed[row] + token - query_start_loc[row]
            np.subtract(num_computed, query_start_loc[:R], out=row_base)
            np.take(row_base, rows, out=pos)
            np.add(pos, self.arange[:total], out=pos)
            np.take(self.row_token_start, rows, out=token_index)
            np.add(token_index, pos, out=token_index)
            row_table_start = np.take(self.row_table_start, rows, out=step_set.column[:total])
        ids = views.ids
        np.take(batch.token_ids.reshape(-1), token_index, out=ids[:total])
        offset, block = step_set.offset[:total], step_set.block[:total]
        # table index = row start + position // block_size (table_index may alias rows: read first)
        np.floor_divide(pos, block_size, out=offset)
        np.add(row_table_start, offset, out=table_index)
        np.remainder(pos, block_size, out=offset)
        for table, slot in zip(self.host_tables, views.slots):
            np.take(table.reshape(-1), table_index, out=block)
            np.multiply(block, block_size, out=slot[:total], dtype=np.int64)
            np.add(slot[:total], offset, out=slot[:total])
            if total < slot.shape[0]:
                slot[total:] = -1  # padding tokens are written nowhere
        if total < ids.shape[0]:
            ids[total:] = 0  # and are token 0 at position 0
            views.positions[total:] = 0
        np.add(num_computed, num_scheduled, out=views.seq_lens, casting="same_kind")
        np.subtract(query_start_loc[1:], 1, out=views.logits)
        np.greater_equal(views.seq_lens, batch.num_tokens[:R], out=views.complete)
        return total

    def _changed_rows(self, num_reqs: int) -> tuple[np.ndarray, int]:
        """The rows whose tables the device copies lack, and how many columns to copy."""
        if not self.separate_device:
            return self.arange[:0], 0  # the device tables are the host tables
        changed = np.flatnonzero(self.synced_version[:num_reqs] != self.batch.row_version[:num_reqs])
        if changed.shape[0] == 0:
            return changed, 0
        width = max(int(num_blocks[changed].max()) for num_blocks in self.num_blocks)
        if width == 0:  # rows without blocks yet: nothing to copy, and they are up to date
            self.synced_version[changed] = self.batch.row_version[changed]
            return self.arange[:0], 0
        return changed, width

    def _pack_table_rows(self, host: np.ndarray, start: int, changed: np.ndarray, width: int) -> int:
        """Changed rows' indices and entries after the step's inputs; returns the end, in words."""
        num_changed = changed.shape[0]
        host[start:start + num_changed] = changed
        start += num_changed
        size = num_changed * width
        entries = host[start:start + (self.num_groups * size + 1) // 2].view(np.int32)
        for g, table in enumerate(self.host_tables):
            entries[g * size:(g + 1) * size].reshape(num_changed, width)[...] = table[changed, :width]
        return start + (self.num_groups * size + 1) // 2

    def _copy(self, step_set: _StepSet, views: _Views, end: int, num_changed: int, width: int) -> None:
        """One host-to-device copy of the used words, then the changed table rows scattered."""
        if num_changed == 0:
            device, host = views.copy_pair
            device.copy_(host, non_blocking=True)
        else:
            device = step_set.device
            device[:end].copy_(step_set.host[:end], non_blocking=True)
            start = views.fixed_end
            index = device[start:start + num_changed]
            entries = device[start + num_changed:end].view(torch.int32)
            size = num_changed * width
            for g, table in enumerate(self.device_tables):
                table[:, :width].index_copy_(0, index, entries[g * size:(g + 1) * size].view(num_changed, width))
