"""The request fields that ask for structured outputs, turned into one ``StructuredOutputsParams``.

Four ways to ask, as OpenAI and vLLM clients send them:

    response_format  {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}
    structured_outputs  vLLM's extra field: {"json": ...} | {"regex": ...} | {"choice": [...]} | ...
    guided_json, guided_regex, guided_choice, guided_grammar  vLLM's older fields

At most one may be set. Every error is a ``RequestFieldError`` naming the field the client sent,
and the grammar is parsed here, so that a bad schema, regex or grammar is a 400 and never reaches
the engine. Parsing imports xgrammar (and torch) the first time: the endpoints call this off the
event loop.
"""

from __future__ import annotations

from typing import Any

from sparrow.entrypoints.openai.request_checks import RequestFieldError, not_supported
from sparrow.sampling_params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams

# response_format types: "text" is no constraint; the others are structured outputs.
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# guided_* field -> StructuredOutputsParams field
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def check_response_format(response_format: Any) -> None:
    """Refuse a response_format that is not an object with a supported type (a 400 before work)."""
    if response_format is None:
        return
    if not isinstance(response_format, dict):
        raise RequestFieldError("response_format must be an object such as {\"type\": \"json_object\"}",
                                "response_format")
    kind = response_format.get("type", "text")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise not_supported("response_format", f"response_format of type {kind!r}",
                            f"; supported types: {', '.join(RESPONSE_FORMAT_TYPES)}")


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any] | None:
    kind = response_format.get("type", "text")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise RequestFieldError("response_format: type json_schema needs json_schema.schema, a JSON schema "
                                    "object (e.g. {\"json_schema\": {\"name\": \"x\", \"schema\": {...}}})",
                                    "response_format")
        return {"json": spec["schema"] if isinstance(spec["schema"], dict) else {}}
    return None


def structured_outputs_of(request: Any) -> StructuredOutputsParams | None:
    """The request's structured outputs, checked and parsed; None when it asks for none."""
    from sparrow.structured_output.grammar import check_structured_outputs

    sources: list[tuple[str, dict[str, Any]]] = []  # (request field, StructuredOutputsParams fields)
    response_format = getattr(request, "response_format", None)
    check_response_format(response_format)
    if response_format is not None:
        fields = _from_response_format(response_format)
        if fields is not None:
            sources.append(("response_format", fields))
    extra = getattr(request, "structured_outputs", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise RequestFieldError("structured_outputs must be an object such as {\"regex\": \"[a-z]+\"}",
                                    "structured_outputs")
        unknown = sorted(set(extra) - set(STRUCTURED_OUTPUT_KINDS))
        if unknown:
            raise not_supported(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]}",
                                f"; supported: {', '.join(STRUCTURED_OUTPUT_KINDS)}")
        sources.append(("structured_outputs", {key: value for key, value in extra.items() if value is not None}))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(request, name, None)
        if value is not None:
            sources.append((name, {kind: value}))
    if not sources:
        return None
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise RequestFieldError(f"{sources[1][0]}: only one structured output may be asked for, got {names}",
                                sources[1][0])
    param, fields = sources[0]
    try:
        params = StructuredOutputsParams(**fields)
        check_structured_outputs(params)
    except (TypeError, ValueError) as exc:
        raise RequestFieldError(f"{param}: {exc}", param) from None
    return params
