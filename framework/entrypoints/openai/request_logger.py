"""``--enable-log-requests``: one INFO line per request the server sends the engine, as vLLM's
RequestLogger writes it: the request id, the prompt text and token ids (each cut to
``--max-log-len``), the sampling parameters and the LoRA adapter."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class RequestLogger:
    """``max_log_len``: how many characters of the prompt, and how many of its token ids, a line
    shows (None: all)."""

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                   params: Any, lora_request: Any = None) -> None:
        limit = self.max_log_len
        if limit is not None:
            prompt = None if prompt is None else prompt[:limit]
            prompt_token_ids = None if prompt_token_ids is None else prompt_token_ids[:limit]
        lora_name = getattr(lora_request, "lora_name", None) if lora_request is not None else None
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                    request_id, prompt, params, prompt_token_ids, lora_name)


def request_logger_from_args(args: Any) -> RequestLogger | None:
    """The server's request logger: None unless ``--enable-log-requests``."""
    if not getattr(args, "enable_log_requests", False):
        return None
    return RequestLogger(getattr(args, "max_log_len", None))
