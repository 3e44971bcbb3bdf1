"""The engine core's own guard on the requests it receives (``check_request``): whatever client sent
a request, a bad one fails alone, before it reaches a step."""

from __future__ import annotations

import logging
import math
from typing import Any

from sparrow.engine.messages import EngineCoreRequest

logger = logging.getLogger(__name__)


def model_vocab_size(model: Any) -> int | None:
    """The vocabulary size (embedding rows) of the engine's model section (``config.model``, with
    its ``trust_remote_code`` and ``hf_overrides``), or None when it cannot be read."""
    if not model.model:
        return None
    try:
        from sparrow.model_loader import model_hf_config

        return int(model_hf_config(model).vocab_size)
    except Exception as exc:  # noqa: BLE001 - the checks fall back to what needs no vocabulary
        logger.warning("cannot read the vocabulary size of %s (%r); token ids are not range-checked", model.model, exc)
        return None


def model_hidden_size(model: Any) -> int | None:
    """The hidden size of the engine's model (what a prompt's embeddings must match), or None
    when it cannot be read."""
    try:
        from sparrow.model_loader import model_hf_config

        return int(model_hf_config(model).hidden_size)
    except Exception as exc:  # noqa: BLE001 - then every prompt_embeds request is refused
        logger.warning("cannot read the hidden size of %s (%r); prompt_embeds are refused", model.model, exc)
        return None


def check_request(request: EngineCoreRequest, *, vocab_size: int | None, max_model_len: int,
                  pooling: bool = False, prompt_embeds_hidden_size: int | None = None) -> None:
    """Raise ValueError, naming the field, for a request the engine core must never run.

    The frontend's input processor checks all this (and more) before it sends a request; this is
    the engine core's own guard, so that a request from any client can fail only itself: an
    out-of-vocabulary id would index past the embedding or the logits in the middle of a step
    and take every other request down with it. ``prompt_embeds_hidden_size``: the model's hidden
    size when prompts may come as embeddings (enable_prompt_embeds), else None.
    """
    def token_range(field: str, token_ids: Any) -> None:
        for position, token_id in enumerate(token_ids):
            if not isinstance(token_id, int) or token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                limit = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
                raise ValueError(f"{field}[{position}] = {token_id!r} is not a token id {limit} "
                                 f"(request {request.request_id!r})")

    if not isinstance(request.request_id, str) or not request.request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request.request_id!r}")
    if pooling != (request.pooling_params is not None):
        raise ValueError(f"request {request.request_id!r} is a {'pooling' if request.pooling_params else 'generation'} "
                         f"request, and this engine runs a {'pooling' if pooling else 'generative'} model (runner="
                         f"{'pooling' if pooling else 'generate'})")
    prompt = request.prompt_token_ids
    if not prompt:
        raise ValueError(f"prompt_token_ids of request {request.request_id!r} is empty")
    if max_model_len and len(prompt) >= max_model_len + pooling:  # a pooling prompt generates nothing
        raise ValueError(f"prompt_token_ids of request {request.request_id!r} holds {len(prompt)} tokens, "
                         f"leaving no room for output under max_model_len={max_model_len}")
    token_range("prompt_token_ids", prompt)
    if request.prompt_embeds is not None:
        check_embeds_data(request, prompt_embeds_hidden_size)
    if request.eos_token_id is not None:
        token_range("eos_token_id", [request.eos_token_id])
    if request.max_tokens is not None and request.max_tokens < 1:
        raise ValueError(f"max_tokens of request {request.request_id!r} must be >= 1, got {request.max_tokens}")
    if not math.isfinite(request.arrival_time):
        raise ValueError(f"arrival_time of request {request.request_id!r} must be finite, got {request.arrival_time}")
    params = request.sampling_params
    if params.n != 1:
        raise ValueError(f"sampling_params.n of request {request.request_id!r} must be 1 in the engine core "
                         f"(the frontend fans n > 1 out into child requests), got {params.n}")
    for field in ("stop_token_ids", "all_stop_token_ids", "allowed_token_ids"):
        token_range(f"sampling_params.{field}", getattr(params, field) or ())
    token_range("sampling_params.logit_bias", list(params.logit_bias or ()))
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(params, field)
        if value is not None and vocab_size is not None and value > vocab_size:
            raise ValueError(f"sampling_params.{field} of request {request.request_id!r} asks for {value} "
                             f"tokens, more than the vocabulary's {vocab_size}")


_ITEM_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_embeds_data(request: EngineCoreRequest, hidden_size: int | None) -> None:
    """A request's prompt embeddings match its prompt and the model (the bytes will be reshaped)."""
    embeds = request.prompt_embeds
    assert embeds is not None
    name = f"prompt_embeds of request {request.request_id!r}"
    if hidden_size is None:
        raise ValueError(f"{name}: this engine was started without enable_prompt_embeds")
    shape = [len(request.prompt_token_ids), hidden_size]
    if list(embeds.shape) != shape:
        raise ValueError(f"{name} has shape {list(embeds.shape)}; the prompt and the model need {shape}")
    item_size = _ITEM_SIZES.get(embeds.dtype)
    if item_size is None:
        raise ValueError(f"{name} has dtype {embeds.dtype!r}, not one of {', '.join(_ITEM_SIZES)}")
    if len(embeds.data) != shape[0] * shape[1] * item_size:
        raise ValueError(f"{name} holds {len(embeds.data)} bytes, not the {shape[0] * shape[1] * item_size} of its "
                         "shape and dtype")
    if request.sampling_params.prompt_logprobs is not None:
        raise ValueError(f"{name}: prompt_logprobs are not available for a prompt given as embeddings")
