"""Sleep mode on a worker (vLLM's ``LLM.sleep`` / ``wake_up``): free the device memory of the KV
cache and the weights while another program (an RLHF trainer, say) uses the device, then take it
back.

* ``sleep(level=1)``: the KV cache is discarded; the weights are offloaded to host memory (on a
  CPU device they are host memory already and stay where they are).
* ``sleep(level=2)``: both are discarded. After ``wake_up`` the weights hold zeros until new ones
  are loaded (``collective_rpc("reload_weights")`` reads the checkpoint again, or an RLHF update
  through ``model.load_weights``).
* ``wake_up(tags)``: ``"weights"`` and/or ``"kv_cache"`` (default both) take their memory back;
  the KV cache comes back zeroed (the engine core reset its prefix cache before sleeping).

Memory is released by shrinking each tensor's storage to nothing and grown back in place on
waking, so every module, view and list keeps the tensors it holds; only their addresses change
(the CUDA worker captures its graphs again). Tensors without a storage of their own (oneDNN's
packed weights) cannot shrink: at level 1 they stay as they are (host memory on the CPU), at
level 2 the op implementation that holds them drops them (``OpImpl.release_weights``) and holds
zeros again on waking.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sparrow.engine.sleep_args import SLEEP_TAGS

logger = logging.getLogger(__name__)


class _Released:
    """Storages shrunk to nothing, with their sizes and (offloaded) contents."""

    def __init__(self, tensors: list[torch.Tensor], offload: bool, keep: _Released | None = None,
                 impls: Any = ()) -> None:
        self.storages: list[tuple[Any, int, torch.Tensor | None]] = []
        self.keep = keep  # released alongside, restored first (buffers beside parameters)
        # Op implementations whose own-layout weights were dropped (level 2), restored last.
        self.impls: list[Any] = []
        self.impl_bytes = 0
        seen: set[int] = {storage.data_ptr() for storage, _, _ in keep.storages} if keep is not None else set()
        for tensor in tensors:
            if tensor.layout != torch.strided or tensor.is_mkldnn:
                continue  # an opaque packed tensor: no storage to shrink
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            if offload and storage.device.type == "cpu":
                continue  # offloading host memory to host memory frees nothing: kept as it is
            saved = None
            if offload:
                saved = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                saved.copy_(torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage))
            self.storages.append((storage, storage.nbytes(), saved))
        for storage, _, _ in self.storages:
            storage.resize_(0)
        for impl in impls:
            released = impl.release_weights()
            if released:
                self.impls.append(impl)
                self.impl_bytes += released

    @property
    def nbytes(self) -> int:
        return (sum(size for _, size, _ in self.storages) + (self.keep.nbytes if self.keep is not None else 0)
                + self.impl_bytes)

    def restore(self) -> None:
        """Grow every storage back: the offloaded contents copied in, the rest zeroed."""
        if self.keep is not None:
            self.keep.restore()
        for storage, size, saved in self.storages:
            storage.resize_(size)
            view = torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage)
            if saved is not None:
                view.copy_(saved)
            else:
                view.zero_()
        for impl in self.impls:  # after the dense weights: a tied head repacks from its table
            impl.restore_weights()


class WorkerSleep:
    """One worker's sleep state: what each tag released, until it is woken."""

    def __init__(self) -> None:
        self.level = 0  # 0: awake
        self.released: dict[str, _Released] = {}

    @property
    def sleeping(self) -> bool:
        return bool(self.released)

    def sleep(self, runner: Any, level: int) -> dict[str, int]:
        """Release the KV cache and the weights of ``runner``; returns the bytes released per tag."""
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level!r}")
        if self.released:
            raise ValueError(f"sleep: already asleep (level {self.level}); call wake_up first")
        parameters, buffers = weight_tensors(runner)
        self.released = {
            "kv_cache": _Released(kv_cache_tensors(runner), offload=False),
            # Buffers (rotary tables: no checkpoint has them) are offloaded at either level.
            "weights": _Released(parameters, offload=level == 1, keep=_Released(buffers, offload=True),
                                 impls=op_impls(runner) if level == 2 else ()),
        }
        self.level = level
        return {tag: released.nbytes for tag, released in self.released.items()}

    def wake_up(self, tags: list[str] | None) -> None:
        for tag in SLEEP_TAGS if tags is None else tags:
            released = self.released.pop(tag, None)
            if released is not None:
                released.restore()
        if not self.released:
            self.level = 0


def kv_cache_tensors(runner: Any) -> list[torch.Tensor]:
    """The runner's KV cache tensors, a speculative proposer's own cache included."""
    cache = getattr(getattr(runner, "proposer", None), "cache", None)
    return [*runner.kv_caches, *(getattr(cache, "kv_caches", None) or [])]


def _models(runner: Any) -> list[Any]:
    """The runner's model and a proposer's models (a draft model, an EAGLE head)."""
    models = [runner.model]
    proposer = getattr(runner, "proposer", None)
    if proposer is not None:
        models += [forward.model for forward in proposer.graph_forwards()]
    return models


def op_impls(runner: Any) -> list[Any]:
    """The op implementations bound to the layers of those models."""
    return [module._op_impl for model in _models(runner) for module in model.modules()
            if getattr(module, "_op_impl", None) is not None]


def weight_tensors(runner: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters, and the buffers, of those models."""
    models = _models(runner)
    return ([param for model in models for param in model.parameters()],
            [buffer for model in models for buffer in model.buffers()])
