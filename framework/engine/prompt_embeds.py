"""vLLM's prompt embeddings (``enable_prompt_embeds``), on the frontend side.

A prompt may come as ``{"prompt_embeds": tensor}`` (``sparrow.inputs.EmbedsPrompt``): a floating
tensor ``[num_tokens, hidden_size]`` (a leading batch dimension of 1 is dropped, as vLLM does)
that the model reads in place of its token embeddings. The engine core then sees placeholder token
ids (0) of the same length; the embeddings themselves key the prefix cache
(``sparrow.core.kv_cache_utils``) and reach the workers in ``NewRequestData.prompt_embeds``.

The server receives them base64-encoded, as bytes ``torch.save`` wrote (vLLM's wire form): they
are loaded with ``weights_only=True``, which builds tensors and plain containers only, never
arbitrary objects. Every refusal is an ``InvalidArgumentError`` naming ``prompt_embeds``.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from sparrow.errors import InvalidArgumentError

FIELD = "prompt_embeds"
_ACCEPTED = ("float32", "bfloat16", "float16", "float64")


def refuse_disabled(label: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{label}: prompt_embeds need an engine started with enable_prompt_embeds=True "
                                "(--enable-prompt-embeds on the server)", FIELD)


def check_prompt_embeds(label: str, value: Any, hidden_size: int | None) -> Any:
    """``value`` as a dense, finite ``[num_tokens, hidden_size]`` tensor of float32, bfloat16 or
    float16 (float64 becomes float32); ``hidden_size`` None: prompt embeddings are off."""
    if hidden_size is None:
        raise refuse_disabled(label)
    import torch

    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(f"{label}: prompt_embeds must be a torch.Tensor [num_tokens, {hidden_size}], got "
                                   f"{type(value).__name__}", FIELD)
    if value.layout != torch.strided:  # vLLM's: a sparse tensor is taken as its dense form
        value = value.to_dense()
    if value.ndim == 3 and value.shape[0] == 1:
        value = value[0]
    if value.ndim != 2 or value.shape[1] != hidden_size:
        raise InvalidArgumentError(f"{label}: prompt_embeds must have shape [num_tokens, {hidden_size}] (the model's "
                                   f"hidden_size), got {list(value.shape)}", FIELD)
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in _ACCEPTED:
        raise InvalidArgumentError(f"{label}: prompt_embeds must be a floating tensor ({', '.join(_ACCEPTED)}), got "
                                   f"{dtype}", FIELD)
    if value.shape[0] == 0:
        raise InvalidArgumentError(f"{label}: prompt_embeds is empty; a prompt needs at least one token", FIELD)
    value = value.detach().to("cpu")
    if dtype == "float64":
        value = value.to(torch.float32)
    if not bool(torch.isfinite(value).all()):
        raise InvalidArgumentError(f"{label}: prompt_embeds holds NaN or infinite values", FIELD)
    return value


def decode_prompt_embeds(encoded: Any, position: int | None = None) -> Any:
    """The tensor a client sent as base64 of ``torch.save`` bytes (not yet checked for shape)."""
    where = FIELD if position is None else f"{FIELD}[{position}]"
    if not isinstance(encoded, str) or not encoded:
        raise InvalidArgumentError(f"{where} must be a non-empty base64 string of a torch.save'd tensor", where)
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{where} is not valid base64", where) from None
    import torch

    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # a truncated archive, a pickle weights_only refuses, not a torch.save file
        raise InvalidArgumentError(f"{where} is not a tensor torch.save wrote "
                                   f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})",
                                   where) from None
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{where} holds a {type(tensor).__name__}, not a tensor", where)
    return tensor


def engine_prompt_length(prompt: Any) -> int:
    """The positions of an engine prompt dict: its token ids, or its embeddings' rows."""
    embeds = prompt.get("prompt_embeds")
    return int(embeds.shape[0]) if embeds is not None else len(prompt["prompt_token_ids"])


def embeds_tensor_data(tensor: Any) -> Any:
    """A checked prompt_embeds tensor as it crosses to the engine core (``wire.TensorData``)."""
    from sparrow.utils.tensor_data import to_tensor_data  # torch: only for a prompt given as embeddings

    return to_tensor_data(tensor)
