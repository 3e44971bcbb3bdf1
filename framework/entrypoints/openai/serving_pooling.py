"""POST /pooling, vLLM's: a pooling model's raw output for each input, for any of the engine's
tasks: ``LLM.encode`` over HTTP. ``task`` (the model's first by default) picks a prompt's vector
(``embed``), a classifier's outputs (``classify``, ``score``) or one row per prompt token
(``token_embed``, ``token_classify``: what a token classifier or a reward model gives); each
result's ``data`` is that output as numbers (nested per token) or base64 float32 bytes.

The inputs are tokenized, checked and submitted as /v1/embeddings does it
(``OpenAIServingEmbedding.embed``): one engine request per input, every one checked and submitted
before the response is committed to, a client's disconnect aborting those not yet computed.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sparrow.entrypoints.openai.protocol_pooling import PoolingRequest, PoolingResponse
from sparrow.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, encode_vector, in_field_words
from sparrow.entrypoints.openai.serving_engine import APIError
from sparrow.outputs import PoolingRequestOutput


class OpenAIServingPooling(OpenAIServingEmbedding):
    request_id_prefix = "pool"

    def check_pooling(self, model: str, endpoint: str = "/pooling") -> None:
        """Any pooling model answers; a generative one is a 400 naming ``model``."""
        if self.engine.input_processor.pooling is None:
            raise APIError(400, f"the model {model!r} is not a pooling model: this server runs it for text "
                           f"generation, and {endpoint} needs one; start one with `sparrow serve MODEL --runner "
                           "pooling` (embedding models, *ForSequenceClassification and *ForTokenClassification "
                           "checkpoints)", "BadRequestError", param="model", code="unsupported")

    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Response:
        model = self.check_request(request, "/pooling")
        request_id = self.new_request_id(raw_request)
        params = self.pooling_params(request_id, task=request.task, dimensions=request.dimensions,
                                     normalize=request.normalize, use_activation=request.use_activation)
        prompts, field = await self.inputs(request, "pools")
        finals = await self.embed(request_id, prompts, params, request, raw_request, in_field_words(field),
                                  what="output")
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._pooled(request_id, model, finals, request.encoding_format))

    @staticmethod
    def _pooled(request_id: str, model: str, finals: list[PoolingRequestOutput],
                encoding_format: str) -> dict[str, Any]:
        """The PoolingResponse as a plain dict (as /v1/embeddings builds its own)."""
        data = [{"index": index, "object": "pooling", "data": encode_vector(final.outputs.data, encoding_format)}
                for index, final in enumerate(finals)]
        prompt_tokens = sum(len(final.prompt_token_ids) for final in finals)
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}


def add_pooling_routes(app: FastAPI, pooling: OpenAIServingPooling,
                       error_responses: dict[int | str, dict[str, Any]]) -> None:
    """vLLM's path, outside /v1 (the API key guards it too: http_guards._GUARDED_PATHS)."""

    @app.post("/pooling", response_model=PoolingResponse, responses=error_responses)
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return await pooling.create_pooling(request, raw_request)
