"""Honour or refuse: every field of a request is implemented, or it is a 400 naming it.

A client that asks for JSON output or a tool call and silently gets free text is worse off than
one told "not supported". So, beyond the fields the endpoints implement:

- fields of features not built yet (tool calling's deprecated forms, ...) are a 400 saying "not
  supported yet" (structured outputs are checked in ``structured_outputs.py``);
- with ``use_beam_search``, the fields beam search cannot honour are a 400 naming them
  (``check_beam_search``);
- any other unknown field, at any depth (content parts too), is a 400 saying "unknown field";
- a few fields that common clients send and that change nothing a client can see here are
  accepted and ignored (``IGNORED_FIELDS``; on messages, ``IGNORED_MESSAGE_FIELDS`` when empty);
- text that UTF-8 cannot encode (a lone surrogate), anywhere in the request, is a 400 naming
  where it is.

``param`` names the field: an unknown or unsupported key by its whole path
(``response_format.json_schema.bogus``), a bad value by its top-level field, except inside
``messages`` where it is the message and key (``messages[2].content``). Errors are
``RequestFieldError`` (a ``sparrow.errors.InvalidArgumentError`` with ``param``); the endpoints
turn them into OpenAI-shaped 400s with that ``param`` as it is.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from sparrow.engine.chat_content import part_text
from sparrow.engine.text_checks import check_text, find_unencodable
from sparrow.errors import InvalidArgumentError

# Accepted and ignored: OpenAI bookkeeping (metadata, store, service_tier).
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier"})
# Keys of assistant messages as OpenAI returns them; clients send those turns back verbatim.
IGNORED_MESSAGE_FIELDS = frozenset({"refusal", "annotations", "audio", "function_call"})

_GUIDED = ("this guided decoding option "
           "(structured outputs take guided_json, guided_regex, guided_choice, guided_grammar)")
NOT_SUPPORTED_YET: dict[str, str] = {
    "functions": "function calling (the deprecated form of tools)",
    "function_call": "function calling (the deprecated form of tool_choice)",
    "logits_processors": "custom logits processors",
    "prompt_embeds": "prompt embeddings",
    "modalities": "output modalities",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "mm_processor_kwargs": "multimodal inputs",
    "kv_transfer_params": "KV cache transfer",
    "cache_control": "cache_control (prompt caching here is automatic)",
}
_GUIDED_PREFIX = "guided_"  # guided_decoding_backend, guided_whitespace_pattern, ... (the four are fields)
_MESSAGE_KEY = re.compile(r"messages\[\d+\](?:\.[^.\[]+)?")
_TOP_LEVEL = re.compile(r"[^.\[]+")


class RequestFieldError(InvalidArgumentError):
    """An invalid or unsupported request field, named as the error's ``param`` (= ``field``)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message, param, code)

    @property
    def param(self) -> str:
        return self.field


def param_of(path: str) -> str:
    """The ``param`` for a field path: ``stop[1]`` -> ``stop``, ``messages[0].content[2].text`` ->
    ``messages[0].content``."""
    match = _MESSAGE_KEY.match(path) or _TOP_LEVEL.match(path)
    return match.group(0) if match else path


_LOCATIONS = ("body", "query", "path", "header")
_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _is_union_tag(part: str) -> bool:
    """A pydantic location step that names a member of a union (``str``, ``list[dict[str,any]]``,
    ``function-after[...]``, a model class), not a field the client wrote."""
    return part in _SCALAR_TAGS or "[" in part or "-" in part or part[:1].isupper()


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A request-schema failure as (message, param), each location as the client wrote it
    (``messages[0].content``), without the union members pydantic tried."""
    parts: list[str] = []
    param = None
    for error in errors:
        location = list(error.get("loc", ()))
        if location and location[0] in _LOCATIONS:  # where, not which field
            location = location[1:]
        path = ""
        for step in location:
            if isinstance(step, int):
                path += f"[{step}]"
            elif not _is_union_tag(str(step)):
                path += f".{step}" if path else str(step)
        # A body that is not JSON at all is located by character offset: no field to name.
        if path and path[0] not in "[0123456789":
            param = param or param_of(path)
        line = f"{path or 'body'}: {error.get('msg')}"
        if line not in parts:
            parts.append(line)
    return "; ".join(parts) or "invalid request", param


def not_supported(field: str, what: str, hint: str = "") -> RequestFieldError:
    return RequestFieldError(f"{field}: {what} is not supported yet{hint}", field, code="unsupported")


def refuse_key(field: str, name: str) -> RequestFieldError:
    """The error for a key ``name`` no request model declares; ``field``, its path, is the param."""
    if name in NOT_SUPPORTED_YET:
        return not_supported(field, NOT_SUPPORTED_YET[name])
    if name.startswith(_GUIDED_PREFIX):
        return not_supported(field, _GUIDED)
    return RequestFieldError(f"{field}: unknown field (check its spelling; the API reference lists the fields this "
                             f"server implements)", field, code="unknown_field")


def content_texts(path: str, parts: list[dict[str, Any]]) -> list[str]:
    """The texts of a message's content parts (``path``: ``messages[i].content``, the param); a 400
    for a part that is not ``{"type": "text", "text": "..."}`` (checked by ``chat_content.part_text``,
    as ``LLM.chat`` checks it) or that has other keys."""
    texts = []
    for index, part in enumerate(parts):
        where = f"{path}[{index}]"
        try:
            texts.append(part_text(where, part))
        except InvalidArgumentError as exc:
            raise RequestFieldError(str(exc), path, code=exc.code or "invalid_value") from None
        for key in part:
            if key not in ("type", "text"):
                raise refuse_key(f"{where}.{key}", key)
    return texts


def check_unicode(request: BaseModel) -> None:
    """Refuse text UTF-8 cannot encode anywhere in the request (keys too). Runs over every string,
    so the endpoints call it off the event loop with the tokenization."""
    found = find_unencodable(request, "")
    if found is None:
        return
    path, text = found
    try:
        check_text(path, text)
    except ValueError as exc:
        raise RequestFieldError(str(exc), param_of(path)) from None


def check_fields(request: BaseModel) -> None:
    """Refuse unknown and not-yet-supported fields, at any depth, and unsupported response format
    types. Fields the request models declare are the endpoints' to honour."""
    from sparrow.entrypoints.openai.structured_outputs import check_response_format

    _check_extras(request, "", top_level=True)
    check_response_format(getattr(request, "response_format", None))
    options = getattr(request, "stream_options", None)
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        raise RequestFieldError("stream_options: continuous_usage_stats needs include_usage to be true",
                                "stream_options")


def _check_extras(model: BaseModel, path: str, *, top_level: bool = False) -> None:
    is_message = path.startswith("messages[") and "." not in path
    for name, value in (model.model_extra or {}).items():
        field = f"{path}.{name}" if path else name
        if top_level and name in IGNORED_FIELDS:
            continue
        if is_message and name in IGNORED_MESSAGE_FIELDS:
            if not value:
                continue
            # A known key of OpenAI's assistant turns: only its content is what cannot be honoured.
            raise not_supported(field, f"a non-empty {name}", " (it is accepted empty or null, as OpenAI returns "
                                                              "assistant turns)")
        raise refuse_key(field, name)
    for name, field_info in type(model).model_fields.items():
        # The path the client wrote: an aliased field by its alias (json_schema.schema).
        _check_nested(getattr(model, name), f"{path}.{field_info.alias or name}" if path else name)
    content = getattr(model, "content", None)
    if is_message and isinstance(content, list):
        content_texts(f"{path}.content", content)


def _check_nested(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        _check_extras(value, path)
    elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
        for index, item in enumerate(value):
            _check_nested(item, f"{path}[{index}]")


# Fields beam search cannot honour (its candidates are each beam's most likely tokens, unfiltered),
# with the values that ask for nothing; an empty value (None, "", [], {}, false) asks for nothing.
_BEAM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,), "min_tokens": (0,), "thinking_token_budget": (-1,),
}
_BEAM_EMPTY = ("stop", "stop_token_ids", "allowed_token_ids", "logit_bias", "bad_words", "vllm_xargs",
               "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structural_tag", "tools", "prompt_logprobs", "repetition_detection")


def check_beam_search(request: BaseModel, max_logprobs: int) -> None:
    """Refuse ``length_penalty`` without ``use_beam_search``, and with it every field beam search
    cannot honour (vLLM's ``to_beam_search_params`` takes n as the beam width, max_tokens,
    ignore_eos, temperature, length_penalty and include_stop_str_in_output): sampling filters and
    penalties, stop conditions, structured outputs, tools, a completion's echo and
    prompt_logprobs, a seed with temperature > 0, and a beam width (``n``) or logprobs beyond what
    a step computes (``2 * n`` logprobs, at most ``max_logprobs``)."""
    if not getattr(request, "use_beam_search", False):
        if getattr(request, "length_penalty", None) is not None:
            raise RequestFieldError("length_penalty: applies only to beam search; set use_beam_search to true",
                                    "length_penalty")
        return

    def refuse(field: str, why: str = "") -> RequestFieldError:
        return RequestFieldError(f"{field}: not supported with use_beam_search{why}", field, code="unsupported")

    for name, neutral in _BEAM_NEUTRAL.items():
        value = getattr(request, name)
        if value is not None and value not in neutral:
            raise refuse(name, " (the beams are ranked by the model's own logprobs; leave it at its default)")
    for name in _BEAM_EMPTY:
        if getattr(request, name, None):
            raise refuse(name)
    if getattr(request, "echo", False) and hasattr(request, "prompt"):
        raise refuse("echo")
    response_format = getattr(request, "response_format", None)
    if response_format is not None and response_format.type != "text":
        raise refuse("response_format")
    if request.seed is not None and request.temperature:  # type: ignore[attr-defined]
        raise refuse("seed", " and temperature > 0 (the token each step samples is not seeded)")
    n = request.n  # type: ignore[attr-defined]
    if 2 * n > max_logprobs:
        raise RequestFieldError(f"n: beam search with n={n} beams needs {2 * n} logprobs per step, more than the "
                                f"server's max_logprobs={max_logprobs}; lower n (at most {max_logprobs // 2})", "n")
    name = "logprobs" if hasattr(request, "prompt") else "top_logprobs"
    logprobs = getattr(request, name)
    if logprobs is not None and logprobs > 2 * n:
        raise RequestFieldError(f"{name}: beam search computes {2 * n} logprobs per token (2 * n); {name}={logprobs} "
                                f"is more", name)
