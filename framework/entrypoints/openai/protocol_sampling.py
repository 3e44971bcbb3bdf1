"""The sampling fields both generation endpoints take (``SamplingFields``: OpenAI's, then vLLM's
extras), with the stream options and ``response_format`` they carry. Re-exported by ``protocol``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from sparrow.entrypoints.openai.protocol_base import RequestModel

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_N = 128  # samples per prompt; each is a sequence in the engine


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = Field(
        False, description="vLLM's: with include_usage, every chunk carries the usage so far.")


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema``, OpenAI's fields: the output matches ``schema``; ``strict``
    is always in effect (the output is generated under the schema's grammar)."""

    name: str | None = None
    description: str | None = None
    # vLLM's name for it: ``schema`` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's response_format: ``type`` text, json_object or json_schema (with ``json_schema``),
    or vLLM's structural_tag (with ``format``, or the older ``structures`` and ``triggers``).
    The type is checked in ``structured_outputs``, so that an unsupported one says so."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class SamplingFields(RequestModel):
    """Sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = Field(None, description="Served model name; defaults to the first one served.")
    n: int = Field(1, ge=1, le=MAX_N, description="Choices to return (null: 1, as OpenAI's default).")
    temperature: float | None = Field(None, ge=0.0, description="Default 1.0; 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-INT64_MAX, le=INT64_MAX)
    structural_tag: str | None = Field(
        None, description="vLLM's older form: a structural tag's JSON text (as response_format's structural_tag).")
    cache_salt: str | None = Field(
        None, min_length=1, description="vLLM's: a salt that keys the request's prefix-cache blocks, so that it "
        "shares cached blocks only with requests of the same salt (tenants kept out of each other's cache).")

    @field_validator("n", mode="before")
    @classmethod
    def _null_n_is_one(cls, value: Any) -> Any:
        return 1 if value is None else value  # OpenAI's reference: "integer or null", default 1
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=INT32_MAX,
        description="Keep only the last k prompt tokens (-1: the most that leave room for one output token).")
    return_tokens_as_token_ids: bool = Field(
        False, description="Logprob tokens as 'token_id:N', so that tokens decoding to the same text stay apart.")
    return_token_ids: bool = Field(
        False, description="vLLM's: the response carries the prompt's token ids (prompt_token_ids) and each "
        "choice's generated ones (token_ids), as the engine saw and produced them.")
    response_format: ResponseFormat | None = Field(
        None, description="{'type': 'text'} (the default), {'type': 'json_object'}, or {'type': 'json_schema', "
        "'json_schema': {'name': ..., 'schema': {...}}}: the output is JSON (matching the schema).")
    # Structured outputs, vLLM's ways (at most one of these and response_format's JSON types).
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: exactly one of json (a schema), json_object, regex, choice, grammar (EBNF).")
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM's older form: a JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM's older form: the output matches this regex.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older form: the output is one of these.")
    guided_grammar: str | None = Field(None, description="vLLM's older form: an EBNF grammar.")
    bad_words: list[str] | None = Field(
        None, description="vLLM's: words never generated (each also after a space; a word of several tokens "
        "bans its last token once the output ends with the others).")
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = Field(
        None, description="vLLM's: per-request arguments for the engine's custom logits processors "
        "(SamplingParams.extra_args).")
    request_id: str | None = Field(
        None, min_length=1, max_length=256, description="vLLM's: the request's id (the response's id is the endpoint's "
        "prefix and it); an X-Request-Id header wins over it; default a random one.")
    thinking_token_budget: int | None = Field(
        None, ge=-1, le=INT64_MAX, description="vLLM's: at most this many tokens of reasoning, then the reasoning's "
        "end marker is written (needs the server's --reasoning-parser; -1: no limit).")
    repetition_detection: dict[str, int] | None = Field(
        None, description="vLLM's: {max_pattern_size, min_pattern_size, min_count}: end the output (finish_reason "
        "'repetition') once it ends with a pattern of that many tokens repeated min_count times.")
    use_beam_search: bool = Field(
        False, description="vLLM's: beam search with n beams; the choices are the n most likely sequences, best "
        "first (temperature defaults to 0; sampling filters, penalties and stop strings are refused).")
    length_penalty: float | None = Field(
        None, description="vLLM's, with use_beam_search: beams are ranked by cum_logprob / length ** "
        "length_penalty (default 1.0; length counts the prompt, not a final EOS).")
