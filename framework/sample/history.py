"""Each row's output tokens as one padded device tensor, kept current by appending what is new.

The penalties need every row's output tokens on the device. Rebuilding a padded tensor from the
Python lists each step costs O(batch x tokens so far) in Python; :class:`OutputHistory` instead
keeps the tensor between steps and writes only the tokens each row gained since the last call
(one per row per decode step), with one host-to-device copy for the whole batch.

Contract with the caller: a row's list is the same list object from step to step while the row
holds that request, and it only grows (``append`` / ``extend``). A list that is a new object (a
request that joined, or came back after preemption) or that got shorter is read again whole;
rows that moved are moved on the device by one gather. The history holds a reference to every
list it mirrors, so no list can be freed and another take its ``id`` while it is compared.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch


class OutputHistory:
    """``update(lists)`` -> [len(lists), max_len] int64 on ``device``, padded with ``pad_id``."""

    def __init__(self, pad_id: int, device: torch.device | str) -> None:
        self.pad_id = pad_id
        self.device = torch.device(device)
        self._ids = torch.full((0, 0), pad_id, dtype=torch.int64, device=self.device)  # capacity
        self._lists: list[list[int]] = []  # the list each row mirrors
        self._list_ids: list[int] = []  # their ids, for a C-speed comparison per step
        self._lengths = np.zeros(0, dtype=np.int64)  # tokens of each row already in _ids

    def update(self, lists: list[list[int]]) -> torch.Tensor:
        num_rows = len(lists)
        list_ids = list(map(id, lists))
        if list_ids != self._list_ids:
            self._relayout(lists, list_ids)
        lengths = np.fromiter(map(len, lists), dtype=np.int64, count=num_rows)
        shrunk = np.flatnonzero(lengths < self._lengths)
        if shrunk.size:  # not append-only: read these rows again from the start
            self._ids[torch.from_numpy(shrunk).to(self.device)] = self.pad_id
            self._lengths[shrunk] = 0
        width = int(lengths.max()) if num_rows else 0
        self._reserve(num_rows, width)
        grown = np.flatnonzero(lengths > self._lengths)
        if grown.size:
            self._write(lists, grown, self._lengths[grown], lengths[grown])
            self._lengths[grown] = lengths[grown]
        return self._ids[:num_rows, :width]

    def _relayout(self, lists: list[list[int]], list_ids: list[int]) -> None:
        """Rows are now ``lists``: rows whose list was already mirrored keep their tokens (moved
        with one gather), the others start empty."""
        old_row = {list_id: row for row, list_id in enumerate(self._list_ids)}
        pairs = [(row, old_row[list_id]) for row, list_id in enumerate(list_ids) if list_id in old_row]
        lengths = np.zeros(len(lists), dtype=np.int64)
        rows = max(len(lists), self._ids.shape[0])
        ids = torch.full((rows, self._ids.shape[1]), self.pad_id, dtype=torch.int64, device=self.device)
        if pairs:
            new_rows, old_rows = (np.asarray(column, dtype=np.int64) for column in zip(*pairs))
            ids[torch.from_numpy(new_rows).to(self.device)] = self._ids[torch.from_numpy(old_rows).to(self.device)]
            lengths[new_rows] = self._lengths[old_rows]
        self._ids, self._lengths = ids, lengths
        self._lists, self._list_ids = list(lists), list_ids

    def _reserve(self, rows: int, width: int) -> None:
        """Grow the capacity (doubling, so appends stay amortised O(1)); contents are kept."""
        old_rows, old_width = self._ids.shape
        if rows <= old_rows and width <= old_width:
            return
        new_rows = max(rows, old_rows)
        new_width = max(width, 2 * old_width, 16) if width > old_width else old_width
        ids = torch.full((new_rows, new_width), self.pad_id, dtype=torch.int64, device=self.device)
        ids[:old_rows, :old_width] = self._ids
        self._ids = ids

    def _write(self, lists: list[list[int]], rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Write tokens ``starts[i]:ends[i]`` of row ``rows[i]`` with one copy to the device."""
        counts = ends - starts
        row_list = rows.tolist()
        if bool((counts == 1).all()):  # a decode step: each row gained its last token
            tokens = [lists[row][-1] for row in row_list]
            row_index, col_index = rows, starts
        else:
            tokens = list(chain.from_iterable(lists[row][start:end] for row, start, end
                                              in zip(row_list, starts.tolist(), ends.tolist())))
            row_index = np.repeat(rows, counts)
            first = np.cumsum(counts) - counts  # where each row's run starts in ``tokens``
            col_index = np.repeat(starts - first, counts) + np.arange(int(counts.sum()))
        packed = torch.from_numpy(np.stack([row_index, col_index, np.asarray(tokens, dtype=np.int64)]))
        packed = packed.to(self.device, non_blocking=True)
        self._ids[packed[0], packed[1]] = packed[2]
