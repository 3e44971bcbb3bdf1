"""From ``StructuredOutputsParams`` to an xgrammar ``Grammar``: the one place that knows how each
kind (json, json_object, regex, choice, grammar, structural_tag) becomes a grammar.

Used twice: by the frontend, which parses every request's grammar before it is sent (a bad schema,
regex or grammar is a ValueError naming the field, and never reaches the engine core), and by the
engine core, which compiles it against the tokenizer. Parsing needs no tokenizer and takes well
under a millisecond for the schemas clients send; compiling is the expensive half (see
``manager.py``).

xgrammar imports torch, so this module is imported lazily and never from ``sparrow.core``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sparrow.sampling_params import StructuredOutputsParams

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; the client needs the rest.
CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def grammar_key(params: StructuredOutputsParams) -> str:
    """A string naming the grammar exactly: the compile cache's key. Two requests with the same
    key get the same compiled grammar (a dict schema is keyed by its canonical JSON)."""
    kind = params.kind
    value: Any = getattr(params, kind)
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value, sort_keys=True, separators=(",", ":"))
    elif kind == "choice":
        value = json.dumps(value, separators=(",", ":"))
    elif kind == "json_object":
        value = ""
    options = "".join(f"+{name}" for name in ("disable_any_whitespace", "disable_additional_properties")
                      if getattr(params, name))
    return f"{kind}{options}:{value}"


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: a JSON string literal is a valid EBNF string literal in xgrammar."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def build_grammar(params: StructuredOutputsParams, *, any_whitespace: bool = False) -> Any:
    """The xgrammar ``Grammar`` for ``params``; ValueError naming the field when it is invalid.

    JSON kinds allow no free whitespace unless ``any_whitespace``: separators are exactly ", " and
    ": " and nothing else may come between tokens, so that a weak model cannot emit whitespace
    until max_tokens (xgrammar's own default allows any amount).
    """
    import xgrammar

    kind = params.kind
    any_whitespace = any_whitespace and not params.disable_any_whitespace
    try:
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            if params.disable_additional_properties:
                schema = _closed_objects(schema)
            return xgrammar.Grammar.from_json_schema(json.dumps(_strict_string_lengths(schema)),
                                                     any_whitespace=any_whitespace)
        if kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgrammar.Grammar.from_ebnf(choice_ebnf(params.choice or []))
        if kind == "structural_tag":
            return _structural_tag_grammar(xgrammar, params.structural_tag or "{}", any_whitespace)
        return xgrammar.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError) as exc:
        message = CPP_PREFIX.sub("", str(exc)).strip()
        raise ValueError(f"structured_outputs.{kind} is invalid: {message}") from None


def _structural_tag_grammar(xgrammar: Any, text: str, any_whitespace: bool) -> Any:
    """A structural tag's grammar. The older form (``structures`` with ``begin``, ``schema`` and
    ``end``, and ``triggers``) is xgrammar's ``triggered_tags`` format, as vLLM builds it; JSON
    schemas in it allow no free whitespace unless ``any_whitespace``, as the JSON kinds."""
    tag = json.loads(text)
    if "structures" in tag:
        tag = {"type": "structural_tag", "format": _triggered_tags(tag)}
    if not any_whitespace:
        tag = _strict_json_contents(xgrammar, tag)
    return xgrammar.Grammar.from_structural_tag(json.dumps(tag))


def _triggered_tags(tag: dict[str, Any]) -> dict[str, Any]:
    """The older structural tag as the ``triggered_tags`` format it means (free text until a
    trigger, then the tag it begins, then free text again); ValueError for a malformed one."""
    unknown = sorted(set(tag) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a key of a structural tag with structures (type, structures, "
                         "triggers)")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be a non-empty list of strings (each a prefix of some begin)")
    tags = []
    for index, item in enumerate(structures):
        if not isinstance(item, dict) or set(item) - {"begin", "schema", "end"} \
                or not all(isinstance(item.get(key), str) for key in ("begin", "end")):
            raise ValueError(f"structures[{index}] must be {{\"begin\": str, \"schema\": {{...}}, \"end\": str}}")
        schema = {} if item.get("schema") is None else item["schema"]
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structures[{index}].schema must be a JSON schema (an object)")
        tags.append({"type": "tag", "begin": item["begin"], "end": item["end"],
                     "content": {"type": "json_schema", "json_schema": schema}})
    for trigger in triggers:
        if not any(tag["begin"].startswith(trigger) for tag in tags):
            raise ValueError(f"trigger {trigger!r} begins none of the structures' begin strings")
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def _strict_json_contents(xgrammar: Any, node: Any) -> Any:
    """``node`` with every JSON-schema format (of the plain JSON style) replaced by the EBNF of
    the same schema without free whitespace, which xgrammar's structural tags would allow."""
    if isinstance(node, list):
        return [_strict_json_contents(xgrammar, item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json" \
            and isinstance(node.get("json_schema"), (dict, bool)) and set(node) <= {"type", "json_schema", "style"}:
        schema = json.dumps(_strict_string_lengths(node["json_schema"]))
        return {"type": "grammar", "grammar": str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))}
    return {key: _strict_json_contents(xgrammar, value) for key, value in node.items()}


# JSON string characters that need no escape: anything but '"', '\\' and the control characters.
_PLAIN_JSON_CHAR = r'[^"\\\x00-\x1f]'
_MAX_REWRITTEN_LENGTH = 100


def _strict_string_lengths(schema: Any) -> Any:
    r"""``schema`` with every length-bounded string rewritten as an equivalent pattern.

    xgrammar (0.2.x) turns ``{"type": "string", "maxLength": n}`` into ``n`` characters of
    ``[^"\\\r\n]``, which lets raw control characters (a vertical tab, say) into the string:
    invalid JSON that ``json.loads`` and pydantic reject. A pattern of plain JSON characters with
    the same bounds keeps the output valid (escape sequences are then not generated). Bounds past
    ``_MAX_REWRITTEN_LENGTH`` are left as they are (xgrammar cannot compile that pattern)."""
    if isinstance(schema, list):
        return [_strict_string_lengths(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {key: _strict_string_lengths(value) for key, value in schema.items()}
    if rewritten.get("type") != "string" or {"pattern", "format", "enum", "const"} & set(rewritten):
        return rewritten
    if not {"minLength", "maxLength"} & set(rewritten):
        return rewritten  # unbounded strings are xgrammar's strict JSON strings already
    low, high = rewritten.get("minLength", 0), rewritten.get("maxLength")
    bounds = [low] if high is None else [low, high]
    # Small integer bounds only: xgrammar fails to compile counted repetitions much past 100, and
    # leaves other values for xgrammar to report.
    if all(type(bound) is int and 0 <= bound <= _MAX_REWRITTEN_LENGTH for bound in bounds):
        rewritten.pop("minLength", None)
        rewritten.pop("maxLength", None)
        rewritten["pattern"] = f"^{_PLAIN_JSON_CHAR}{{{low},{'' if high is None else high}}}$"
    return rewritten


def _closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` in every ``"type": "object"`` schema that
    does not say (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    kind = closed.get("type")
    if (kind == "object" or (isinstance(kind, list) and "object" in kind)) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def check_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """Raise ValueError naming the field when ``params`` holds a grammar xgrammar cannot parse."""
    if params is not None:
        build_grammar(params)
