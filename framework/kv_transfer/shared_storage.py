"""A KV connector through a shared directory: finished prefills are saved block by block, keyed
by the block's chained hash, and another engine with the same model loads them instead of
recomputing. The simplest disaggregated prefill: producer and consumer share only a path.

Configuration: ``kv_connector="shared_storage"``, ``kv_role`` producer / consumer / both,
``kv_connector_extra_config={"storage_path": "/some/dir"}``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from sparrow.core.kv_cache_utils import update_request_block_hashes
from sparrow.hookspecs import hookimpl
from sparrow.kv_transfer.base import KVConnectorBase, KVConnectorRole


class SharedStorageMeta(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    # (block_id, block_hash_hex) pairs
    loads: list[tuple[int, str]] = []
    saves: list[tuple[int, str]] = []


class SharedStorageConnector(KVConnectorBase):
    metadata_type = SharedStorageMeta

    def __init__(self, role: KVConnectorRole, config: Any, block_size: int) -> None:
        super().__init__(role, config, block_size)
        path = config.kv_connector_extra_config.get("storage_path")
        if not path:
            raise ValueError("kv_connector_extra_config['storage_path'] is required by the shared_storage connector")
        self.storage_path = Path(path)
        self.storage_path.mkdir(parents=True, exist_ok=True)
        # Scheduler side: req_id -> (first external block index, number of blocks)
        self._matched: dict[str, tuple[int, int]] = {}
        self._pending_loads: list[tuple[int, str]] = []

    def _file(self, block_hash_hex: str, rank: int = 0) -> Path:
        return self.storage_path / f"{block_hash_hex}.rank{rank}.safetensors"

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        if not self.is_consumer or request.sampling_params.prompt_logprobs is not None:
            return 0
        hashes = update_request_block_hashes(request, self.block_size)
        # Full prompt blocks, keeping the last prompt token to be computed.
        usable = (request.num_prompt_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        count = 0
        while first + count < min(usable, len(hashes)) and self._file(hashes[first + count].hex()).exists():
            count += 1
        if count:
            self._matched[request.request_id] = (first, count)
        return count * self.block_size

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens == 0:
            return
        first, count = matched
        for index in range(first, first + count):
            self._pending_loads.append((blocks.blocks[index].block_id, request.block_hashes[index].hex()))

    def build_connector_meta(self, scheduler_output: Any, requests: dict[str, Any]) -> SharedStorageMeta:
        meta = SharedStorageMeta(loads=self._pending_loads)
        self._pending_loads = []
        if not self.is_producer:
            return meta
        # Save the full prompt blocks of every prefill that completes in this step.
        for req_id, num_new_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            before = request.num_computed_tokens
            if before < request.num_prompt_tokens <= before + num_new_tokens:
                hashes = update_request_block_hashes(request, self.block_size)
                block_ids = self._block_ids(request)
                num_full = request.num_prompt_tokens // self.block_size
                for index in range(min(num_full, len(hashes), len(block_ids))):
                    hex_hash = hashes[index].hex()
                    if not self._file(hex_hash).exists():
                        meta.saves.append((block_ids[index], hex_hash))
        return meta

    def _block_ids(self, request: Any) -> list[int]:
        return self.kv_cache_manager.get_block_ids(request.request_id)

    # -- worker side --------------------------------------------------------------------------
    def start_load_kv(self, metadata: SharedStorageMeta) -> None:
        if not metadata.loads:
            return
        from safetensors.torch import load_file

        for block_id, hex_hash in metadata.loads:
            stacked = load_file(str(self._file(hex_hash, self.rank)))["kv"]  # [num_layers, 2, block_size, H, D]
            for layer, cache in enumerate(self.kv_caches):
                cache[:, block_id].copy_(stacked[layer].to(cache.device, cache.dtype))

    def save_kv(self, metadata: SharedStorageMeta) -> None:
        if not metadata.saves:
            return
        import torch
        from safetensors.torch import save_file

        for block_id, hex_hash in metadata.saves:
            target = self._file(hex_hash, self.rank)
            if target.exists():
                continue
            stacked = torch.stack([cache[:, block_id] for cache in self.kv_caches]).cpu().contiguous()
            tmp = target.with_suffix(f".tmp{os.getpid()}")
            save_file({"kv": stacked}, str(tmp))
            os.replace(tmp, target)  # readers never see a partial file


@hookimpl
def sparrow_register_kv_connectors(register) -> None:
    register("shared_storage", SharedStorageConnector)
