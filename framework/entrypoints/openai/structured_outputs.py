"""The request fields that ask for structured outputs, turned into one ``StructuredOutputsParams``.

Four ways to ask, as OpenAI and vLLM clients send them:

    response_format  {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}},
                     or vLLM's {"type": "structural_tag", "format": {...}} (or "structures" and "triggers")
    structured_outputs  vLLM's extra field: {"json": ...} | {"regex": ...} | {"choice": [...]} | ...
    guided_json, guided_regex, guided_choice, guided_grammar, structural_tag  vLLM's older fields

At most one may be set. Every error is a ``RequestFieldError`` naming the field the client sent,
and the grammar is parsed here, so that a bad schema, regex or grammar is a 400 and never reaches
the engine. Parsing imports xgrammar (and torch) the first time: the endpoints call this off the
event loop.
"""

from __future__ import annotations

import json
from typing import Any

from sparrow.entrypoints.openai.protocol import ResponseFormat
from sparrow.entrypoints.openai.request_checks import RequestFieldError, not_supported
from sparrow.errors import InvalidArgumentError
from sparrow.sampling_params import STRUCTURED_OUTPUT_KINDS, STRUCTURED_OUTPUT_OPTIONS, StructuredOutputsParams

# response_format types: "text" is no constraint; the others are structured outputs.
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
# vLLM's older request fields (guided_*, structural_tag) -> StructuredOutputsParams field
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "structural_tag": "structural_tag"}
# response_format fields that go with one type only
_TYPED_FIELDS = {"json_schema": ("json_schema",), "format": ("structural_tag",), "structures": ("structural_tag",),
                 "triggers": ("structural_tag",)}


def check_response_format(response_format: ResponseFormat | None) -> None:
    """Refuse a response_format of an unsupported type, or one whose json_schema its type would
    ignore (a 400 before work)."""
    if response_format is None:
        return
    kind = response_format.type
    if kind not in RESPONSE_FORMAT_TYPES:
        raise not_supported("response_format", f"response_format of type {kind!r}",
                            f"; supported types: {', '.join(RESPONSE_FORMAT_TYPES)}")
    for name, types in _TYPED_FIELDS.items():
        if getattr(response_format, name) is not None and kind not in types:
            raise RequestFieldError(f"response_format.{name}: only allowed with type {types[0]}, got type {kind!r} "
                                    f"(which would ignore it)", f"response_format.{name}")
    if kind == "structural_tag":
        has_format = response_format.format is not None
        has_structures = response_format.structures is not None or response_format.triggers is not None
        if has_format == has_structures:
            raise RequestFieldError("response_format: type structural_tag needs either format (xgrammar's structural "
                                    "tag format) or structures and triggers (the older form), "
                                    + ("not both" if has_format else "and got neither"), "response_format")


def _from_response_format(response_format: ResponseFormat) -> tuple[dict[str, Any], str] | None:
    """The StructuredOutputsParams fields a response_format asks for, and the path of the field
    that holds them (for messages); None for type text."""
    if response_format.type == "json_object":
        return {"json_object": True}, "response_format"
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise RequestFieldError("response_format: type json_schema needs json_schema.schema, a JSON schema "
                                    "object (e.g. {\"json_schema\": {\"name\": \"x\", \"schema\": {...}}})",
                                    "response_format")
        schema = spec.json_schema
        return {"json": schema if isinstance(schema, dict) else {}}, "response_format.json_schema.schema"
    if response_format.type == "structural_tag":  # the whole response_format, as vLLM passes it on
        tag = {name: getattr(response_format, name) for name in ("type", "format", "structures", "triggers")
               if getattr(response_format, name) is not None}
        return {"structural_tag": json.dumps(tag)}, "response_format"
    return None


def _client_words(message: str, field: str, fields: dict[str, Any]) -> str:
    """A StructuredOutputsParams or grammar message in the words of the request: ``field`` is
    where the client wrote what it asked for (``guided_regex is invalid: ...``, not
    ``structured_outputs.regex is invalid: ...``)."""
    message = message.removeprefix("StructuredOutputsParams: ")
    if field != "structured_outputs" and len(fields) == 1:
        message = message.replace(f"structured_outputs.{next(iter(fields))}", field)
    return message if message.startswith(field) else f"{field}: {message}"


def _sources(request: Any) -> list[tuple[str, dict[str, Any], str]]:
    """Every structured output the request asks for: (request field, StructuredOutputsParams
    fields, where the client wrote them)."""
    sources: list[tuple[str, dict[str, Any], str]] = []
    response_format = getattr(request, "response_format", None)
    check_response_format(response_format)
    if response_format is not None:
        asked = _from_response_format(response_format)
        if asked is not None:
            sources.append(("response_format", *asked))
    extra = getattr(request, "structured_outputs", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise RequestFieldError("structured_outputs must be an object such as {\"regex\": \"[a-z]+\"}",
                                    "structured_outputs")
        unknown = sorted(set(extra) - set(STRUCTURED_OUTPUT_KINDS) - set(STRUCTURED_OUTPUT_OPTIONS)
                         - {"whitespace_pattern"})
        if unknown:
            raise not_supported(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]}",
                                f"; supported: {', '.join(STRUCTURED_OUTPUT_KINDS + STRUCTURED_OUTPUT_OPTIONS)}")
        fields = {key: value for key, value in extra.items() if value is not None}
        sources.append(("structured_outputs", fields, "structured_outputs"))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(request, name, None)
        if value is not None:
            sources.append((name, {kind: value}, name))
    return sources


def structured_outputs_of(request: Any) -> StructuredOutputsParams | None:
    """The request's structured outputs, checked and parsed; None when it asks for none."""
    from sparrow.structured_output.grammar import check_structured_outputs

    sources = _sources(request)
    if not sources:
        return None
    if len(sources) > 1:
        names = " and ".join(source[0] for source in sources)
        raise RequestFieldError(f"{sources[1][0]}: only one structured output may be asked for, got {names}",
                                sources[1][0])
    param, fields, where = sources[0]
    try:
        params = StructuredOutputsParams(**fields)
        check_structured_outputs(params)
    except (TypeError, ValueError) as exc:
        named = getattr(exc, "field", None)
        if where == "structured_outputs" and isinstance(named, str) and named.startswith("structured_outputs."):
            param = named  # the key of the request's own structured_outputs object
        raise RequestFieldError(_client_words(str(exc), where, fields), param) from None
    return params


def in_request_words(exc: ValueError, request: Any) -> ValueError:
    """An engine-side failure of the request's grammar (its compile, its timeout, its masks'
    cost: an InvalidArgumentError naming ``structured_outputs.KIND``) as a RequestFieldError naming
    the field the client wrote the grammar in (``guided_regex``, ``response_format``, ...; a grammar
    built from the tools is ``tool_choice``'s). Any other error is returned unchanged."""
    field = getattr(exc, "field", None)
    if not isinstance(exc, InvalidArgumentError) or not field or not field.startswith("structured_outputs"):
        return exc
    try:
        sources = _sources(request)
    except ValueError:  # checked before the request was submitted; cannot fail here
        sources = []
    if not sources:
        return RequestFieldError(_client_words(str(exc), "tool_choice", {}), "tool_choice")
    param, fields, where = sources[0]
    return RequestFieldError(_client_words(str(exc), where, fields), param)
