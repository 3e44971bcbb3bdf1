"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the served tokenizer, as vLLM exposes it.

Clients that count or budget tokens (lm-evaluation-harness's remote tokenizer, proxies, UIs) call
these instead of loading the model's tokenizer themselves, so they must tokenize exactly as the
generation endpoints do: a chat request is rendered by the chat endpoint's own ``render_prompt``,
and a text prompt is encoded by the engine's input processor.

    POST /tokenize     {prompt, add_special_tokens=true}              -> {count, max_model_len, tokens, token_strs}
                       {messages, add_generation_prompt, tools, ...}  -> the same, for the chat prompt
    POST /detokenize   {tokens}                                        -> {prompt}
    GET  /tokenizer_info                                               -> tokenizer_config.json's fields,
                                                                          tokenizer_class, chat_template, ...
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, Field, ValidationError

from sparrow.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    OpenAIBaseModel,
    RequestModel,
    TokenId,
    Tool,
)
from sparrow.entrypoints.openai.request_checks import RequestFieldError, check_fields, check_unicode
from sparrow.entrypoints.openai.serving_chat import render_prompt, template_request
from sparrow.entrypoints.openai.serving_engine import APIError, OpenAIServing, field_error

# -- requests and responses (vLLM's shapes) -----------------------------------------------------------


class TokenizeCompletionRequest(RequestModel):
    model: str | None = Field(None, description="Served model name; defaults to the first one served.")
    prompt: str
    add_special_tokens: bool = Field(True, description="Let the tokenizer add its special tokens (BOS, ...), "
                                                       "as /v1/completions does by default.")
    return_token_strs: bool | None = Field(False, description="Also return each token as the tokenizer spells it.")


class TokenizeChatRequest(RequestModel):
    model: str | None = Field(None, description="Served model name; defaults to the first one served.")
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False, description="Leave the last message open (needs add_generation_prompt=false).")
    add_special_tokens: bool = Field(False, description="The chat template writes the special tokens; default false.")
    chat_template: str | None = Field(None, description="A Jinja chat template instead of the tokenizer's.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")
    tools: list[Tool] | None = Field(None, description="Tools shown to the chat template, as the chat endpoint does.")
    return_token_strs: bool | None = Field(False, description="Also return each token as the tokenizer spells it.")


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = Field(None, description="Served model name; defaults to the first one served.")
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class TokenizerInfoResponse(OpenAIBaseModel):
    """The tokenizer's configuration (tokenizer_config.json's fields as the tokenizer holds them)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


def parse_tokenize_request(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The chat form when the body has ``messages``, else the text form (vLLM's rule). A body with
    both is the chat form, whose ``prompt`` is then refused as an unknown field."""
    model = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # The app's handler words it as every other 400: the field path, then what is wrong.
        raise RequestValidationError(exc.errors()) from None


# -- work done on the engine's input thread ---------------------------------------------------------


def tokenize(input_processor: Any, request: TokenizeCompletionRequest | TokenizeChatRequest,
             chat_template: str | None = None, content_format: str = "auto") -> tuple[list[int], list[str] | None]:
    """The request's token ids, and their spellings when asked for; ``chat_template`` and
    ``content_format``: the server's --chat-template and --chat-template-content-format."""
    if isinstance(request, TokenizeChatRequest):
        token_ids = tokenize_chat(input_processor, request, chat_template, content_format)
    else:
        check_unicode(request)
        token_ids = input_processor.tokenize(request.prompt, add_special_tokens=request.add_special_tokens)
    token_strs = input_processor.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
    return token_ids, token_strs


def tokenize_chat(input_processor: Any, request: Any, chat_template: str | None = None,
                  content_format: str = "auto") -> list[int]:
    """The token ids /v1/chat/completions would send the engine for these messages: the chat
    endpoint's ``render_prompt`` (which checks every string) on a chat request holding the same
    rendering fields."""
    chat_request = ChatCompletionRequest.model_construct(
        messages=request.messages, add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message, add_special_tokens=bool(request.add_special_tokens),
        chat_template=request.chat_template, chat_template_kwargs=request.chat_template_kwargs,
        tools=getattr(request, "tools", None))
    return render_prompt(input_processor, chat_request, chat_template, content_format)["prompt_token_ids"]


def detokenize(input_processor: Any, token_ids: list[int]) -> str:
    vocab_size = input_processor.vocab_size
    for position, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise RequestFieldError(f"tokens: token id {token_id} at position {position} is outside the "
                                    f"vocabulary [0, {vocab_size})", "tokens")
    # Special tokens are kept, so that detokenize(tokenize(text)) gives back what the model saw.
    return input_processor.tokenizer.decode(token_ids, skip_special_tokens=False)


# The tokenizer's init arguments that are paths on the server or loading switches: nothing a client
# can use, and the server's file layout is none of its business.
_LOCAL_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local",
                         "local_files_only", "cache_dir", "_commit_hash", "special_tokens_map_file"})
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(item) for item in value]
    content = getattr(value, "content", None)  # transformers' AddedToken: its text, as vLLM reports it
    return content if isinstance(content, str) else str(value)


def tokenizer_info(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """tokenizer_config.json's fields as the loaded tokenizer holds them (vLLM's /tokenizer_info),
    with the special tokens and the chat template (the server's --chat-template when given, as
    vLLM reports it) always present (clients test for them)."""
    config = {key: value for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in _LOCAL_KEYS}
    info = _jsonable(config)
    for name in _SPECIAL_TOKENS:
        info[name] = _jsonable(getattr(tokenizer, name, None))
    info["chat_template"] = _jsonable(chat_template if chat_template is not None
                                      else getattr(tokenizer, "chat_template", None))
    info["model_max_length"] = _jsonable(getattr(tokenizer, "model_max_length", info.get("model_max_length")))
    info["tokenizer_class"] = type(tokenizer).__name__
    return info


# -- the endpoints ------------------------------------------------------------------------------------


class OpenAIServingTokenization(OpenAIServing):
    """``chat_template``: the server's --chat-template (None: the tokenizer's);
    ``chat_template_content_format``: its --chat-template-content-format."""

    request_id_prefix = "tok"

    def __init__(self, engine: Any, served_model_names: list[str], chat_template: str | None = None,
                 chat_template_content_format: str = "auto") -> None:
        super().__init__(engine, served_model_names)
        self.chat_template = chat_template
        self.chat_template_content_format = chat_template_content_format
        self._tokenizer_info: TokenizerInfoResponse | None = None

    def _input_processor(self) -> Any:
        input_processor = self.engine.input_processor
        if input_processor.tokenizer is None:
            raise APIError(400, "this server was started without a tokenizer; it takes and returns token ids only",
                           "BadRequestError", code="unsupported")
        return input_processor

    @staticmethod
    def _check_fields(request: OpenAIBaseModel) -> None:
        try:
            check_fields(request)
        except RequestFieldError as exc:
            raise field_error(exc) from None

    async def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(request.model)
        self._check_fields(request)
        self.check_chat_template(request)
        default_param = "messages" if isinstance(request, TokenizeChatRequest) else "prompt"
        if isinstance(request, TokenizeChatRequest):
            request = template_request(request, self)
        token_ids, token_strs = await self.off_loop(tokenize, self._input_processor(), request, self.chat_template,
                                                    self.chat_template_content_format, default_param=default_param)
        return TokenizeResponse(count=len(token_ids), max_model_len=self.engine.model_config.max_model_len,
                                tokens=token_ids, token_strs=token_strs)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self._check_fields(request)
        input_processor = self._input_processor()
        text = await self.off_loop(detokenize, input_processor, request.tokens, default_param="tokens")
        return DetokenizeResponse(prompt=text)

    async def get_tokenizer_info(self) -> TokenizerInfoResponse:
        if self._tokenizer_info is None:  # the tokenizer never changes: built once
            tokenizer = self._input_processor().tokenizer
            self._tokenizer_info = TokenizerInfoResponse(**await self.off_loop(tokenizer_info, tokenizer,
                                                                                self.chat_template))
        return self._tokenizer_info
