"""``--enable-log-requests``: one INFO line per request the server sends the engine, as vLLM's
RequestLogger writes it: the request id, the prompt text and token ids (each cut to
``--max-log-len``), the sampling parameters and the LoRA adapter. ``--enable-log-outputs`` adds
one line per choice when the request finishes: its text and token ids (cut the same way, whole
even when the response streamed deltas) and its finish reason."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

from sparrow.outputs import RequestOutput
from sparrow.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


class RequestLogger:
    """``max_log_len``: how many characters of the prompt, and how many of its token ids, a line
    shows (None: all); ``log_outputs``: log each finished request's outputs too."""

    def __init__(self, max_log_len: int | None = None, log_outputs: bool = False) -> None:
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                   params: Any, lora_request: Any = None) -> None:
        limit = self.max_log_len
        if limit is not None:
            prompt = None if prompt is None else prompt[:limit]
            prompt_token_ids = None if prompt_token_ids is None else prompt_token_ids[:limit]
        lora_name = getattr(lora_request, "lora_name", None) if lora_request is not None else None
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                    request_id, prompt, params, prompt_token_ids, lora_name)


    def log_finished(self, request_id: str, texts: dict[int, str], token_ids: dict[int, list[int]],
                     output: RequestOutput) -> None:
        limit = self.max_log_len
        for completion in output.outputs:
            text = texts.get(completion.index, "")
            ids = token_ids.get(completion.index, [])
            logger.info("Generated response %s (choice %d): output: %r, output_token_ids: %s, finish_reason: %s.",
                        request_id, completion.index, text if limit is None else text[:limit],
                        ids if limit is None else ids[:limit], completion.finish_reason)

    async def logged(self, request_id: str, stream: AsyncGenerator[RequestOutput, None],
                     output_kind: RequestOutputKind) -> AsyncGenerator[RequestOutput, None]:
        """``stream`` unchanged, logging its outputs when it finishes (deltas put together)."""
        texts: dict[int, str] = {}
        token_ids: dict[int, list[int]] = {}
        try:
            async for output in stream:
                for completion in output.outputs:
                    if output_kind == RequestOutputKind.DELTA:
                        texts[completion.index] = texts.get(completion.index, "") + completion.text
                        token_ids.setdefault(completion.index, []).extend(completion.token_ids)
                    else:
                        texts[completion.index] = completion.text
                        token_ids[completion.index] = list(completion.token_ids)
                if output.finished:
                    self.log_finished(request_id, texts, token_ids, output)
                yield output
        finally:
            await stream.aclose()


def request_logger_from_args(args: Any) -> RequestLogger | None:
    """The server's request logger: None unless ``--enable-log-requests``."""
    if not getattr(args, "enable_log_requests", False):
        return None
    return RequestLogger(getattr(args, "max_log_len", None), bool(getattr(args, "enable_log_outputs", False)))
