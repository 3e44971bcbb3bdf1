"""Errors in OpenAI's shape (``{"error": {message, type, param, code}}``), and how an engine-side
error becomes one: the field it names, in the request's words (``stop[0]``, not
``SamplingParams.stop[0]``)."""

from __future__ import annotations

import re
from typing import Any

from sparrow.engine.exceptions import EngineDeadError, EngineShutdownError
from sparrow.entrypoints.openai.request_checks import RequestFieldError, param_of
from sparrow.errors import InvalidArgumentError

# Fallback for plain ValueErrors (a plugin's logits processor, a tokenizer): the request fields
# such a message may name first.
_PARAM_NAMES = {
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logit_bias", "allowed_token_ids", "prompt", "messages", "chat_template",
    "priority", "truncate_prompt_tokens", "chat_template_kwargs", "continue_final_message", "add_generation_prompt",
    "tools", "tool_choice", "model", "user", "bad_words", "vllm_xargs",
}
# A leading field name, and inside messages the message and key: "messages[1].content: ...".
_LEADING_NAME = re.compile(r"^([a-z_]+)(\[\d+\](?:\.[a-z_]+)?)?")
# Engine-side field names -> the request field the client sent.
_REQUEST_FIELD = {"prompt_token_ids": "prompt", "extra_args": "vllm_xargs"}
_ENGINE_CLASS_PREFIX = "SamplingParams."  # how SamplingParams' own checks name a field


class APIError(Exception):
    """An error the server answers with ``{"error": {message, type, param, code}}``."""

    def __init__(self, status_code: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": _printable(self.message), "type": self.err_type,
                          "param": None if self.param is None else _printable(self.param), "code": self.code}}


def _printable(text: str) -> str:
    """``text`` with lone surrogates escaped: an error may quote the bad input, and JSON encoded
    as UTF-8 cannot carry them (the response would fail to render: a 500)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def client_words(message: str) -> str:
    """An engine-side message as the client should read it: a field named as the request names
    it (``stop[0]``, not ``SamplingParams.stop[0]``; ``vllm_xargs``, not ``extra_args``)."""
    message = message.removeprefix(_ENGINE_CLASS_PREFIX)
    match = _LEADING_NAME.match(message)
    if match and match.group(1) in _REQUEST_FIELD:
        message = _REQUEST_FIELD[match.group(1)] + message[match.end(1):]
    return message


def request_param(field: str) -> str:
    """The OpenAI ``param`` for an InvalidArgumentError's field: the top-level request field
    (``stop[1]`` -> ``stop``; ``extra_args`` -> ``vllm_xargs``), or inside ``messages`` the
    message and key (``messages[2].content``)."""
    param = param_of(field)
    return _REQUEST_FIELD.get(param, param)


def bad_request(exc: ValueError, default_param: str | None = None) -> APIError:
    """A 400 for an invalid value: ``param`` is an InvalidArgumentError's field; for a plain
    ValueError, the field its message starts with, else ``default_param``."""
    message = client_words(str(exc))
    if isinstance(exc, RequestFieldError):
        # The request checks chose the param: for a nested key, its whole path.
        return APIError(400, message, "BadRequestError", param=exc.param, code=exc.code or "invalid_value")
    if isinstance(exc, InvalidArgumentError):
        return APIError(400, message, "BadRequestError", param=request_param(exc.field),
                        code=exc.code or "invalid_value")
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match and match.group(1) in _PARAM_NAMES else default_param
    if match and param == "messages" and match.group(2):
        param += match.group(2)
    return APIError(400, message, "BadRequestError", param=param, code="invalid_value")


def field_error(exc: RequestFieldError) -> APIError:
    return bad_request(exc)


def engine_dead(exc: EngineDeadError) -> APIError:
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), "ServiceUnavailableError", code="shutting_down")
    return APIError(503, f"the engine is not running: {exc}", "ServiceUnavailableError", code="engine_dead")
