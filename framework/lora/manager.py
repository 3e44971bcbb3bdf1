"""The worker's LoRA manager: adapters cached on the host, ``max_loras`` device slots swapped in
least-recently-used order, and each step's token -> slot mapping.

    host cache   lora_int_id -> LoRAWeights (float32), at most max_cpu_loras, LRU; read from disk
                 once and again only after being evicted from it
    slots        slot -> lora_int_id on the device (every targeted layer's stacked A/B); a step
                 needs its adapters in slots, and evicts the least recently used adapters that
                 the step does not use
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sparrow.lora.layers import StepLoRAState, attach_hooks, build_lora_layers, module_shapes, write_slot
from sparrow.lora.peft import LoRAWeights, load_adapter
from sparrow.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoRAStats:
    """Cumulative counters (never reset): adapters read from disk, written into a device slot, and
    written into a slot that held another adapter (a swap)."""

    num_disk_loads: int = 0
    num_slot_loads: int = 0
    num_swaps: int = 0


class LoRAManager:
    """Built by the model runner when ``enable_lora``; owns the hooks on the model's layers."""

    def __init__(self, model: Any, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 device: torch.device, dtype: torch.dtype, platform: str | None = None) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.device = device
        self.layers = build_lora_layers(model, max_loras, max_lora_rank, device, dtype)
        self.module_shapes = module_shapes(model)
        self.num_layers = len(model.model.layers)
        if platform is not None:
            from sparrow.ops.binding import resolve_function_op

            op = resolve_function_op("add_lora", platform)
        else:
            from sparrow.lora.ops import add_lora as op
        self.state = StepLoRAState(torch.zeros(max_loras, dtype=torch.float32, device=device))
        self._hooks = attach_hooks(model, self.layers, self.state, op)
        self.host_cache: OrderedDict[int, LoRAWeights] = OrderedDict()  # least recently used first
        self.slots: list[LoRAWeights | None] = [None] * max_loras  # the adapter each device slot holds
        self.slot_lru: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))
        self.stats = LoRAStats()

    # -- adapters on the host ---------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> bool:
        """Load an adapter into the host cache (True), or refresh its place there (False)."""
        return self._host_weights(request)[1]

    def _host_weights(self, request: LoRARequest) -> tuple[LoRAWeights, bool]:
        cached = self.host_cache.get(request.lora_int_id)
        if cached is not None and (cached.name, cached.path) == (request.lora_name, request.lora_path):
            self.host_cache.move_to_end(request.lora_int_id)
            return cached, False
        if cached is not None:  # the id now names another adapter: forget the old weights
            self.remove_adapter(request.lora_int_id)
        weights = load_adapter(request.lora_name, request.lora_int_id, request.lora_path,
                               max_lora_rank=self.max_lora_rank, num_layers=self.num_layers,
                               module_shapes=self.module_shapes)
        self.stats.num_disk_loads += 1
        self.host_cache[request.lora_int_id] = weights
        while len(self.host_cache) > self.max_cpu_loras:
            evicted, _ = self.host_cache.popitem(last=False)
            logger.debug("LoRA adapter %d dropped from the host cache", evicted)
        return weights, True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter on the host and in its slot; False if it was not loaded."""
        found = self.host_cache.pop(lora_int_id, None) is not None
        slot = self._slot_of(lora_int_id)
        if slot is not None:
            self._write(slot, None)
            found = True
        return found

    def list_adapters(self) -> list[int]:
        return sorted(set(self.host_cache) | {w.int_id for w in self.slots if w is not None})

    # -- slots ------------------------------------------------------------------------------
    def _write(self, slot: int, weights: LoRAWeights | None) -> None:
        for layer in self.layers:
            write_slot(layer, slot, weights, self.max_lora_rank)
        self.slots[slot] = weights
        self.state.scalings[slot] = weights.scaling if weights is not None else 0.0

    def _slot_of(self, lora_int_id: int) -> int | None:
        return next((slot for slot, w in enumerate(self.slots) if w is not None and w.int_id == lora_int_id), None)

    def _slot_for(self, request: LoRARequest, in_use: set[int]) -> int:
        int_id = request.lora_int_id
        resident = self._slot_of(int_id)
        if resident is not None:
            held = self.slots[resident]
            # The same id may name another adapter since (re-registered): then the slot is stale.
            if held is not None and (held.name, held.path) == (request.lora_name, request.lora_path):
                self.slot_lru.move_to_end(resident)
                return resident
        weights, _ = self._host_weights(request)
        slot = next(s for s in self.slot_lru if s not in in_use)  # least recently used free slot
        previous = self.slots[slot]
        if previous is not None and previous.int_id != int_id:
            self.stats.num_swaps += 1
            logger.debug("LoRA slot %d: adapter %s swapped out for %d", slot, previous.int_id, int_id)
        if resident is not None and resident != slot:
            self._write(resident, None)
        self._write(slot, weights)
        self.stats.num_slot_loads += 1
        self.slot_lru.move_to_end(slot)
        return slot

    # -- the step ---------------------------------------------------------------------------
    def prepare_step(self, row_requests: list[LoRARequest | None], num_scheduled: np.ndarray,
                     num_tokens: int) -> bool:
        """Map this step's tokens to slots (rows in batch order, ``num_scheduled`` tokens each, then
        padding up to ``num_tokens``), swapping adapters in as needed. Returns whether any token
        uses an adapter; the hooks stay idle otherwise.

        With speculative decoding a row's ``num_scheduled`` counts its draft tokens too, so the
        target verifies every draft with the row's adapter (a draft model or EAGLE head has no
        hooks: it drafts with the base weights, as in vLLM)."""
        wanted = {r.lora_int_id: r for r in row_requests if r is not None}
        if not wanted:
            self.state.active = False
            return False
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters but max_loras={self.max_loras}; the "
                               "scheduler must keep to max_loras")
        in_use: set[int] = set()
        slot_of: dict[int, int] = {}
        for int_id in sorted(wanted, key=lambda i: self._slot_of(i) is None):  # resident first: never evicted
            slot = self._slot_for(wanted[int_id], in_use)
            in_use.add(slot)
            slot_of[int_id] = slot
        row_slots = np.fromiter((slot_of[r.lora_int_id] if r is not None else -1 for r in row_requests),
                                dtype=np.int64, count=len(row_requests))
        token_slots = np.full(num_tokens, -1, dtype=np.int64)
        total = int(num_scheduled.sum())
        token_slots[:total] = np.repeat(row_slots, num_scheduled)
        tensor = torch.from_numpy(token_slots)
        self.state.token_slots = tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)
        self.state.active = True
        return True

    def finish_step(self) -> None:
        self.state.active = False
        self.state.token_slots = None

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
