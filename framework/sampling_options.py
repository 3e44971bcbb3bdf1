"""The parameter objects a ``SamplingParams`` carries (vLLM's classes, names and fields):
``StructuredOutputsParams`` (a grammar the output follows) and ``RepetitionDetectionParams``
(when a looping output is ended), validated at construction and again when the engine core
decodes them (an invalid value is an ``InvalidArgumentError`` naming the field); and
``ThinkingMarkers``, which the input processor fills in for a request with a
``thinking_token_budget``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from sparrow.errors import InvalidArgumentError


class StructuredOutputsParams(
    msgspec.Struct, omit_defaults=True, array_like=True, kw_only=True,  # type: ignore[call-arg]
    forbid_unknown_fields=True,
):
    """Constrain a request's output to a grammar (vLLM's fields; exactly one is set).

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object;
    ``regex``: the whole output matches it; ``choice``: the output is one of these strings;
    ``grammar``: an EBNF grammar (GBNF style, with a ``root`` rule); ``structural_tag``: vLLM's
    structural tag, the JSON text of ``{"type": "structural_tag", "format": {...}}`` (xgrammar's
    format: tags, sequences, JSON schemas, triggered tags...) or of the older ``{"type":
    "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}`` (free text
    until a trigger starts a tag, whose content follows its schema). Checked here for shape; the
    frontend compiles the grammar before the request reaches the engine core (see
    ``sparrow.structured_output.check``), so a bad schema, regex or grammar is a ValueError
    naming the field there.

    vLLM's options: ``disable_any_whitespace`` (JSON without free whitespace for this request,
    whatever the engine's ``structured_outputs_any_whitespace``; compact is the engine default),
    ``disable_additional_properties`` (json only: every ``"type": "object"`` schema without
    ``additionalProperties`` takes ``false``), ``disable_fallback`` (no other backend is ever
    tried: xgrammar is the only one, so it holds either way). ``whitespace_pattern`` (outlines')
    is refused: xgrammar takes none.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        import json as json_module

        chosen = [name for name in STRUCTURED_OUTPUT_KINDS
                  if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(chosen) != 1:
            got = " and ".join(chosen) if chosen else "none"
            raise InvalidArgumentError(f"StructuredOutputsParams: exactly one of "
                                       f"{', '.join(STRUCTURED_OUTPUT_KINDS)} must be set, got {got}",
                                       "structured_outputs")
        for name in STRUCTURED_OUTPUT_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"structured_outputs.{name} must be true or false, got "
                                           f"{getattr(self, name)!r}", f"structured_outputs.{name}")
        if self.whitespace_pattern is not None:
            raise InvalidArgumentError("structured_outputs.whitespace_pattern is not supported: the xgrammar backend "
                                       "takes no whitespace pattern (JSON is compact, or any whitespace with the "
                                       "engine's structured_outputs_any_whitespace; disable_any_whitespace forces "
                                       "compact)", "structured_outputs.whitespace_pattern")
        if self.disable_additional_properties and chosen[0] != "json":
            raise InvalidArgumentError(f"structured_outputs.disable_additional_properties applies to a json schema, "
                                       f"not {chosen[0]}", "structured_outputs.disable_additional_properties")
        if isinstance(self.json, str):
            try:
                schema = json_module.loads(self.json)
            except ValueError as exc:
                raise InvalidArgumentError(f"structured_outputs.json is not valid JSON: {exc}",
                                           "structured_outputs.json") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidArgumentError(f"structured_outputs.json must be a JSON schema (an object), got "
                                           f"{type(schema).__name__}", "structured_outputs.json")
        elif self.json is not None and not isinstance(self.json, Mapping):
            raise InvalidArgumentError(f"structured_outputs.json must be a dict or a JSON string, got "
                                       f"{type(self.json).__name__}", "structured_outputs.json")
        if self.json_object is not None and self.json_object is not True:
            raise InvalidArgumentError(f"structured_outputs.json_object must be True when set, got "
                                       f"{self.json_object!r}", "structured_outputs.json_object")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(f"structured_outputs.{name} must be a non-empty string, got {value!r}",
                                           f"structured_outputs.{name}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence) or not self.choice:
                raise InvalidArgumentError(f"structured_outputs.choice must be a non-empty list of strings, got "
                                           f"{self.choice!r}", "structured_outputs.choice")
            for index, text in enumerate(self.choice):
                if not isinstance(text, str) or not text:
                    raise InvalidArgumentError(f"structured_outputs.choice[{index}] must be a non-empty string, "
                                               f"got {text!r}", f"structured_outputs.choice[{index}]")
            self.choice = list(self.choice)
        if self.structural_tag is not None:
            try:
                tag = json_module.loads(self.structural_tag)
            except ValueError as exc:
                raise InvalidArgumentError(f"structured_outputs.structural_tag is not valid JSON: {exc}",
                                           "structured_outputs.structural_tag") from None
            if not isinstance(tag, dict):
                raise InvalidArgumentError(f"structured_outputs.structural_tag must be a JSON object, got "
                                           f"{type(tag).__name__}", "structured_outputs.structural_tag")

    @property
    def kind(self) -> str:
        """The field that is set: json, json_object, regex, choice, grammar or structural_tag."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS
                    if getattr(self, name) is not None and getattr(self, name) is not False)


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# vLLM's boolean options beside the kind (whitespace_pattern, its other one, is refused).
STRUCTURED_OUTPUT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# vLLM's boolean options beside the kind (whitespace_pattern, its other one, is refused).
STRUCTURED_OUTPUT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
# vLLM's name for StructuredOutputsParams before 0.11 (``SamplingParams(guided_decoding=...)``).
GuidedDecodingParams = StructuredOutputsParams



# RepetitionDetectionParams' bounds: the engine core checks the tail of every output token by token,
# comparing at most MAX_REPETITION_TAIL tokens.
MAX_PATTERN_SIZE = 1024
MAX_REPETITION_TAIL = 16384


class RepetitionDetectionParams(
    msgspec.Struct, omit_defaults=True, array_like=True, kw_only=True,  # type: ignore[call-arg]
    forbid_unknown_fields=True,
):
    """vLLM's repetition detection: the request ends (finish_reason ``"repetition"``, stop_reason
    ``"repetition_detected"``) as soon as its output ends with a pattern of ``min_pattern_size`` to
    ``max_pattern_size`` tokens repeated ``min_count`` times in a row. ``max_pattern_size`` 0 turns
    it off; ``min_pattern_size`` 0 means 1. A model stuck in a loop stops there instead of at
    ``max_tokens``."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"repetition_detection.{name} must be an integer >= 0, got {value!r}",
                                           f"repetition_detection.{name}")
        if self.max_pattern_size == 0:
            return
        if self.max_pattern_size > MAX_PATTERN_SIZE:
            raise InvalidArgumentError(f"repetition_detection.max_pattern_size must be at most {MAX_PATTERN_SIZE}, "
                                       f"got {self.max_pattern_size}", "repetition_detection.max_pattern_size")
        if self.min_pattern_size > self.max_pattern_size:
            raise InvalidArgumentError(f"repetition_detection.min_pattern_size must be <= max_pattern_size="
                                       f"{self.max_pattern_size}, got {self.min_pattern_size}",
                                       "repetition_detection.min_pattern_size")
        if self.min_count < 2:
            raise InvalidArgumentError(f"repetition_detection.min_count must be >= 2 (a pattern seen that many times "
                                       f"in a row ends the request), got {self.min_count}",
                                       "repetition_detection.min_count")
        if self.max_pattern_size * self.min_count > MAX_REPETITION_TAIL:
            raise InvalidArgumentError(f"repetition_detection: max_pattern_size * min_count must be at most "
                                       f"{MAX_REPETITION_TAIL} (the output tail examined after every token), got "
                                       f"{self.max_pattern_size} * {self.min_count}", "repetition_detection.min_count")

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0


def ends_in_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether ``token_ids`` end with a pattern of ``min_pattern_size``-``max_pattern_size`` tokens
    repeated ``min_count`` times. Called after every output token: a pattern length is looked at
    only when the last token equals the one a pattern earlier, and is then confirmed with one
    slice comparison (the tail shifted by the pattern equals itself)."""
    count, num_tokens = params.min_count, len(token_ids)
    last = token_ids[-1] if num_tokens else None
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        span = size * count
        if span > num_tokens:
            break
        if token_ids[-1 - size] != last:
            continue
        tail = token_ids[num_tokens - span:]
        if tail[size:] == tail[:-size]:
            return True
    return False


class ThinkingMarkers(msgspec.Struct, omit_defaults=True, array_like=True, kw_only=True,  # type: ignore[call-arg]
                      forbid_unknown_fields=True):
    """Where a request's reasoning starts and ends, as token ids, for its ``thinking_token_budget``:
    filled in by the input processor from the engine's reasoning parser. ``open_in_prompt``: the
    prompt's current turn leaves the reasoning open (its chat template wrote the start marker)."""

    start_token_ids: list[int]
    end_token_ids: list[int]
    open_in_prompt: bool = False

    def __post_init__(self) -> None:
        for name in ("start_token_ids", "end_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise InvalidArgumentError(f"thinking_markers.{name} must be a list of token ids, got {ids!r}",
                                           f"thinking_markers.{name}")
        if not self.end_token_ids:
            raise InvalidArgumentError("thinking_markers.end_token_ids must hold at least one token id",
                                       "thinking_markers.end_token_ids")
