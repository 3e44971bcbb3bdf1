"""LoRA checks on the engine side (frontend and engine core): the configuration before start-up,
and each request's adapter before it reaches a worker. Torch-free.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Sequence

from sparrow.errors import InvalidArgumentError
from sparrow.hub_cache import local_or_cached
from sparrow.lora.peft import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    check_adapter,
    check_lora_architecture,
    projection_shapes,
    read_adapter_config,
)
from sparrow.lora.request import LoRARequest


def check_lora_config(config: Any, hf_config: Any) -> tuple[str, str] | None:
    """(field, message) for a configuration LoRA cannot run with, else None.

    Tensor parallelism, quantization and speculative decoding all combine with LoRA: adapters are
    sliced per rank as the base weights are (a model whose heads or MLP do not split is refused by
    the ``parallel`` check already, and an adapter's rank never splits), the update is added in the
    activation dtype to whatever the (quantized) layer computes, and the target verifies drafts
    with each request's adapter (a draft model or EAGLE head drafts without adapters, as in vLLM).
    What remains is the architecture: the llama-family decoder's projections."""
    if not config.lora.enable_lora:
        return None
    try:
        check_lora_architecture(hf_config)
    except ValueError as exc:
        return ("enable_lora", str(exc))
    return None


def check_lora_request(lora_request: Any, config: Any, hf_config: Any = None) -> None:
    """Raise InvalidArgumentError naming ``lora_request`` for an adapter this engine cannot run:
    LoRA off, not a LoRARequest, or a directory whose config (rank above ``max_lora_rank``,
    bias, modules_to_save, ...) or, with ``hf_config``, whose tensors do not fit the model."""
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        raise InvalidArgumentError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}",
                                   "lora_request")
    if not config.lora.enable_lora:
        raise InvalidArgumentError(f"lora_request {lora_request.lora_name!r} needs an engine started with "
                                   "enable_lora=True", "lora_request")
    try:
        _check_directory(lora_request.lora_path, config.lora.max_lora_rank, hf_config)
    except ValueError as exc:
        raise InvalidArgumentError(f"lora_request {lora_request.lora_name!r}: {exc}", "lora_request") from None


# Adapter directories that passed, keyed by their files' modification times, the rank limit and
# the model's shapes: every request naming an adapter is checked (in the frontend and again in
# the engine core), and without this each would read its config and weights header from disk.
_PASSED: OrderedDict[tuple[Any, ...], None] = OrderedDict()
_PASSED_MAX = 256


def _check_directory(path: str, max_lora_rank: int, hf_config: Any) -> None:
    directory = local_or_cached(path)
    try:
        stamp = tuple(os.stat(directory / name).st_mtime_ns for name in (CONFIG_FILE, WEIGHTS_FILE))
    except OSError:
        stamp = None  # a missing file: the check below says which
    model = None if hf_config is None else (hf_config.num_hidden_layers,
                                            tuple(sorted(projection_shapes(hf_config).items())))
    key = (str(directory), stamp, max_lora_rank, model)
    if stamp is not None and key in _PASSED:
        _PASSED.move_to_end(key)
        return
    if hf_config is not None:
        check_adapter(path, max_lora_rank=max_lora_rank, hf_config=hf_config)
    else:
        read_adapter_config(path, max_lora_rank)
    if stamp is not None:
        _PASSED[key] = None
        while len(_PASSED) > _PASSED_MAX:
            _PASSED.popitem(last=False)


def lora_requests_per_prompt(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """``lora_request`` (one for every prompt, or a list with one per prompt) as a list; ValueError
    naming ``lora_request`` for a list of the wrong length."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, Sequence) and not isinstance(lora_request, (str, bytes)):
        requests = list(lora_request)
        if len(requests) != num_prompts:
            raise InvalidArgumentError(f"lora_request: got {len(requests)} LoRA requests for {num_prompts} prompts; "
                                       "pass one for all or one per prompt", "lora_request")
        for index, item in enumerate(requests):
            if item is not None and not isinstance(item, LoRARequest):
                raise InvalidArgumentError(f"lora_request[{index}] must be a LoRARequest or None, got "
                                           f"{type(item).__name__}", f"lora_request[{index}]")
        return requests
    raise InvalidArgumentError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, got "
                               f"{type(lora_request).__name__}", "lora_request")
