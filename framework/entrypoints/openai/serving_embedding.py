"""POST /v1/embeddings: one vector per input from a pooling (embedding) model (``--runner
pooling``), in OpenAI's shape; floats or base64 (little-endian float32 bytes, as OpenAI encodes
them and the openai client decodes them).

Each input is one engine request, all of them submitted before the response is committed to, so
that an invalid input is a 400 and costs the others nothing; they then run side by side in the
engine's batches. Text inputs are tokenized here, with the request's ``add_special_tokens``, and
cut to its ``truncate_prompt_tokens``, so that the engine receives the token ids it embeds and
``usage`` counts them.
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncGenerator
from typing import Any, Callable

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sparrow.engine.exceptions import EngineDeadError
from sparrow.entrypoints.openai.protocol_classify import ClassificationRequest
from sparrow.entrypoints.openai.protocol_embeddings import MAX_EMBEDDING_INPUTS, EmbeddingRequest
from sparrow.entrypoints.openai.request_checks import RequestFieldError, check_fields, check_unicode
from sparrow.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    bad_request,
    collect_finals,
    engine_dead,
    field_error,
)
from sparrow.entrypoints.openai.streams import cancel_on_disconnect
from sparrow.errors import InvalidArgumentError
from sparrow.outputs import PoolingRequestOutput
from sparrow.pooling_params import PoolingParams

# How the engine names a prompt in its errors, and the field the client sent it in here.
_PROMPT_FIELDS = frozenset({"prompt", "prompt_token_ids"})


def embedding_inputs(request: EmbeddingRequest | ClassificationRequest) -> list[tuple[str, str | list[int]]]:
    """The request's inputs as (label, text or token ids): one per vector (or per classification:
    /classify takes the same inputs). Labels name the input in messages as the client wrote it
    (``input``, ``input[2]``)."""
    value = request.input
    if isinstance(value, str):
        return [("input", value)]
    if not value:
        raise RequestFieldError("input must not be empty; send a string, a list of strings, a list of token ids or "
                                "a list of lists of token ids", "input")
    items: list[Any] = list(value)  # all strings, all token ids, or all lists of them (the request model)
    if all(isinstance(item, int) for item in items):
        return [("input", items)]
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise RequestFieldError(f"input has {len(items)} inputs; at most {MAX_EMBEDDING_INPUTS} per request "
                                "(send several requests)", "input")
    return [(f"input[{index}]", item if isinstance(item, str) else list(item)) for index, item in enumerate(items)]


def tokenize_inputs(input_processor: Any, request: EmbeddingRequest | ClassificationRequest,
                    verb: str = "embeds") -> list[dict[str, Any]]:
    """Every input as an engine prompt (``tokenize_one``). Blocking: the endpoint runs it on the
    engine's input thread."""
    check_unicode(request)
    add_special_tokens = True if request.add_special_tokens is None else request.add_special_tokens
    return [tokenize_one(input_processor, label, item, field="input", add_special_tokens=add_special_tokens,
                         truncate_prompt_tokens=request.truncate_prompt_tokens, verb=verb)
            for label, item in embedding_inputs(request)]


def chat_inputs(input_processor: Any, request: EmbeddingRequest | ClassificationRequest, chat_template: str | None,
                content_format: str, verb: str = "embeds") -> list[dict[str, Any]]:
    """vLLM's chat form: the messages rendered as /v1/chat/completions renders them (the
    request's template, else the server's --chat-template, else the tokenizer's), one input.
    Blocking: the endpoint runs it on the engine's input thread."""
    from sparrow.entrypoints.openai.serving_tokenization import tokenize_chat

    if input_processor.tokenizer is None:
        raise RequestFieldError("messages: the chat form needs the model's tokenizer, and this server has none "
                                "(skip_tokenizer_init); send token ids as input", "messages")
    token_ids = tokenize_chat(input_processor, request, chat_template, content_format)
    return [tokenize_one(input_processor, "messages", token_ids, field="messages", add_special_tokens=False,
                         truncate_prompt_tokens=request.truncate_prompt_tokens, verb=verb)]


def tokenize_one(input_processor: Any, label: str, item: str | list[int], *, field: str, add_special_tokens: bool,
                 truncate_prompt_tokens: int | None, verb: str = "embeds") -> dict[str, Any]:
    """One input as an engine prompt, ``{"prompt": text, "prompt_token_ids": [...]}`` (no text for
    token inputs or cut ones), checked: not empty, inside the vocabulary, and short enough for the
    model once cut to ``truncate_prompt_tokens``. ``label`` names the input in messages
    (``input[2]``), ``field`` is the request field a refusal names, ``verb`` what the model does
    with an input in the too-long message ("embeds", "classifies")."""
    max_len = input_processor.max_model_len
    text = None
    if isinstance(item, str):
        if not item:
            raise RequestFieldError(f"{label} is an empty string; every input needs some text", field)
        if input_processor.tokenizer is None:
            raise RequestFieldError(f"{label}: text inputs need the model's tokenizer, and this server has none "
                                    "(skip_tokenizer_init); send token ids", field)
        text = item
        item = input_processor.tokenize(item, add_special_tokens=add_special_tokens, field=label)
        if not item:
            raise RequestFieldError(f"{label} tokenizes to no tokens (add_special_tokens="
                                    f"{str(add_special_tokens).lower()}); every input needs at least one", field)
    elif not item:
        raise RequestFieldError(f"{label} is an empty list of token ids; every input needs at least one", field)
    else:
        check_vocabulary(label, item, input_processor.vocab_size, field)
    token_ids = input_processor.truncate(item, truncate_prompt_tokens, max_len)
    if len(token_ids) > max_len:
        # The engine's limit, in this endpoint's words.
        raise RequestFieldError(f"{label} is {len(token_ids)} tokens long; this model {verb} at most "
                                f"{max_len} tokens per input (max_model_len); shorten it or set "
                                "truncate_prompt_tokens", field)
    return ({"prompt_token_ids": token_ids} if text is None or len(token_ids) < len(item)
            else {"prompt": text, "prompt_token_ids": token_ids})


def check_vocabulary(label: str, token_ids: list[int], vocab_size: int, field: str = "input") -> None:
    """A 400 naming the first token id the model has no embedding for (the engine would refuse
    it too, naming a prompt of a request id the client never saw)."""
    if max(token_ids) < vocab_size:  # ids are >= 0 (the request model)
        return
    position = next(index for index, token_id in enumerate(token_ids) if token_id >= vocab_size)
    raise RequestFieldError(f"{label}[{position}]: token id {token_ids[position]} is outside the model's vocabulary "
                            f"[0, {vocab_size})", field)


def encode_vector(vector: Any, encoding_format: str) -> list[Any] | str:
    """A float32 vector (or /pooling's rows of them) as the response carries it: numbers, or
    OpenAI's base64 of its little-endian float32 bytes (row after row)."""
    values = np.asarray(vector.numpy() if hasattr(vector, "numpy") else vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return values.tolist()


def pooling_model_kind(pooling: Any) -> tuple[str, str]:
    """(what a pooling model is, the endpoints that answer for it), for messages."""
    if pooling.head == "embed":
        return "an embedding model", "/v1/embeddings, /v1/score, /v1/rerank and /pooling"
    if "classify" not in pooling.supported_tasks:
        return f"a token classifier ({pooling.num_labels} labels)", "/pooling (task token_classify)"
    labels = f"{pooling.num_labels} label{'' if pooling.num_labels == 1 else 's'}"
    return f"a classifier ({labels})", "/classify, /v1/score, /v1/rerank and /pooling" if pooling.num_labels == 1 \
        else "/classify and /pooling"

class OpenAIServingEmbedding(OpenAIServing):
    # The chat form's rendering: the server's --chat-template and its content format (api_server).
    chat_template: str | None = None
    chat_template_content_format: str = "auto"

    request_id_prefix = "embd"

    def check_pooling(self, model: str, endpoint: str = "/v1/embeddings") -> None:
        """A generative engine has no vectors to give, nor a classifier: a 400 saying how to serve
        an embedding model."""
        pooling = self.engine.input_processor.pooling
        if pooling is not None and pooling.head == "classify":
            kind, answers = pooling_model_kind(pooling)
            raise APIError(400, f"the model {model!r} is {kind}, not an embedding model: it answers {answers}, not "
                           f"{endpoint}; serve an embedding model for vectors", "BadRequestError",
                           param="model", code="unsupported")
        if pooling is None:
            raise APIError(400, f"the model {model!r} is not an embedding model: this server runs it for text "
                           f"generation, and {endpoint} needs a pooling model; start one with `sparrow serve "
                           "MODEL --runner pooling` (a checkpoint saved without its LM head, such as architecture "
                           "Qwen3Model, is served as one by default)", "BadRequestError", param="model",
                           code="unsupported")

    def check_request(self, request: Any, endpoint: str = "/v1/embeddings") -> str:
        """The served model a pooling request names, once it is one this server embeds with and the
        request has no field it cannot honour."""
        model = self.check_model(request.model)
        self.check_pooling(model, endpoint)
        try:
            check_fields(request)
        except RequestFieldError as exc:
            raise field_error(exc) from None
        return model

    def pooling_params(self, request_id: str, **fields: Any) -> PoolingParams:
        """The model's pooling with the request's ``fields`` (PoolingParams keywords), checked
        against the model (``dimensions``) before any tokenizing."""
        try:
            return self.engine.input_processor.pooling.resolve(request_id, PoolingParams(**fields))
        except InvalidArgumentError as exc:
            raise bad_request(exc) from None

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        model = self.check_request(request)
        request_id = self.new_request_id(raw_request)
        params = self.pooling_params(request_id, dimensions=request.dimensions, normalize=request.normalize)
        prompts, field = await self.inputs(request, "embeds")
        finals = await self.embed(request_id, prompts, params, request, raw_request, in_field_words(field))
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._response(request_id, model, finals, request.encoding_format))

    async def inputs(self, request: EmbeddingRequest | ClassificationRequest, verb: str
                     ) -> tuple[list[dict[str, Any]], str]:
        """The request's engine prompts, from ``input`` or from vLLM's chat form (``messages``),
        and the field that holds them; exactly one of the two, and the chat fields only with
        ``messages`` (400s naming the field)."""
        chat = request.messages is not None
        if chat == (request.input is not None):
            field = "messages" if chat else "input"
            raise field_error(RequestFieldError(f"{field}: send either input (texts or token ids) or messages (vLLM's "
                                                "chat form), " + ("not both" if chat else "and got neither"), field))
        if not chat:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"):
                if getattr(request, name):
                    raise field_error(RequestFieldError(f"{name}: applies to the chat form (messages); this request "
                                                        "sends input", name))
            return await self.off_loop(tokenize_inputs, self.engine.input_processor, request, verb,
                                       default_param="input"), "input"
        self.check_chat_template(request)
        from sparrow.entrypoints.openai.serving_chat import template_request

        return await self.off_loop(chat_inputs, self.engine.input_processor, template_request(request, self),
                                   self.chat_template, self.chat_template_content_format, verb,
                                   default_param="messages"), "messages"

    async def embed(self, request_id: str, prompts: list[dict[str, Any]], params: PoolingParams, request: Any,
                    raw_request: Request, rejected: Callable[[ValueError], APIError],
                    labels: list[str] | None = None, what: str = "embedding") -> list[PoolingRequestOutput] | None:
        """Every prompt's pooled output, in order (None: the client went away, and the prompts not
        yet pooled were aborted). ``request`` gives ``model`` (the LoRA adapter) and ``priority``;
        ``rejected`` turns an engine-side refusal into the request's words; ``labels`` name the
        prompts in messages (by default ``input i``), ``what`` the output in them."""
        streams = await self._submit(request_id, prompts, params, request, rejected)
        finals = await cancel_on_disconnect(raw_request, collect_finals(streams, rejected))
        if finals is not None:
            for index, final in enumerate(finals):
                if final.outputs.data is None:  # ended before its vector was computed (the server is stopping)
                    label = labels[index] if labels is not None else f"input {index}"
                    raise APIError(503, f"{label} was aborted before its {what} was computed",
                                   "ServiceUnavailableError", code="aborted")
        return finals

    async def _submit(self, request_id: str, prompts: list[dict[str, Any]], params: PoolingParams, request: Any,
                      rejected: Callable[[ValueError], APIError]) -> list[AsyncGenerator[Any, None]]:
        """One engine request per input, each validated as it is submitted; a refused one aborts
        those submitted before it."""
        engine = self.engine
        lora_request = self.lora_request_of(request.model)
        submitted: list[str] = []
        streams = []
        try:
            for index, prompt in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                self.log_inputs(sub_id, prompt, params, lora_request)
                collector = await engine.add_request(sub_id, prompt, params,  # type: ignore[arg-type]
                                                     priority=request.priority, lora_request=lora_request)
                submitted.append(sub_id)
                streams.append(engine.stream_outputs(sub_id, collector))
        except ValueError as exc:
            await engine.abort(submitted)
            raise rejected(exc) from None
        except EngineDeadError as exc:
            await engine.abort(submitted)
            raise engine_dead(exc) from None
        return streams

    @staticmethod
    def _response(request_id: str, model: str, finals: list[PoolingRequestOutput],
                  encoding_format: str) -> dict[str, Any]:
        """The EmbeddingResponse as a plain dict: a response can hold millions of numbers, which
        pydantic would validate one by one only to dump them again."""
        data = [{"object": "embedding", "embedding": encode_vector(final.outputs.data, encoding_format),
                 "index": index} for index, final in enumerate(finals)]
        prompt_tokens = sum(len(final.prompt_token_ids) for final in finals)
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def in_field_words(field: str) -> Callable[[ValueError], APIError]:
    """An engine-side refusal as a 400; one naming the prompt names ``field``, the request field
    that carried it here."""
    def rejected(exc: ValueError) -> APIError:
        error = bad_request(exc, default_param=field)
        if error.param in _PROMPT_FIELDS:
            error.param = field
        return error

    return rejected

