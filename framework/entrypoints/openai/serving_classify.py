"""POST /classify, vLLM's: a sequence classifier's class probabilities for each input (a
``*ForSequenceClassification`` checkpoint, served with ``--runner pooling``, the default for one),
as ``LLM.classify`` gives them offline: the score layer's logits through the model's activation
(softmax; sigmoid for one label), or the raw logits with ``use_activation`` false. Each result's
``label`` is config.json's ``id2label`` of its most probable class.

The inputs are tokenized, checked and submitted as /v1/embeddings does it
(``OpenAIServingEmbedding.embed``): one engine request per input, every one checked and submitted
before the response is committed to, a client's disconnect aborting those not yet computed.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sparrow.entrypoints.openai.protocol_classify import ClassificationRequest, ClassificationResponse
from sparrow.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, in_field_words, pooling_model_kind
from sparrow.entrypoints.openai.serving_engine import APIError
from sparrow.outputs import PoolingRequestOutput


def class_labels(hf_config: Any, num_classes: int) -> list[str]:
    """Each class's name: config.json's ``id2label`` (transformers fills in ``LABEL_i`` when the
    checkpoint names none; its keys are ints, or strings in a raw config)."""
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = []
    for index in range(num_classes):
        label = id2label.get(index, id2label.get(str(index))) if isinstance(id2label, dict) else None
        labels.append(str(label) if label is not None else f"LABEL_{index}")
    return labels


class OpenAIServingClassify(OpenAIServingEmbedding):
    request_id_prefix = "classify"

    def check_pooling(self, model: str, endpoint: str = "/classify") -> None:
        """Only a classifier has classes: a 400 naming ``model`` on an embedding or a generative model."""
        pooling = self.engine.input_processor.pooling
        if pooling is not None and "classify" in pooling.supported_tasks:
            return
        if pooling is not None:
            kind, answers = pooling_model_kind(pooling)
            raise APIError(400, f"the model {model!r} is {kind}: it answers {answers}, not {endpoint}; serve a "
                           "sequence classifier (a *ForSequenceClassification checkpoint) to classify",
                           "BadRequestError", param="model", code="unsupported")
        raise APIError(400, f"the model {model!r} is not a classifier: this server runs it for text generation, and "
                       f"{endpoint} needs a sequence classifier; start one with `sparrow serve MODEL` on a "
                       "*ForSequenceClassification checkpoint (served with --runner pooling by default)",
                       "BadRequestError", param="model", code="unsupported")

    async def create_classify(self, request: ClassificationRequest, raw_request: Request) -> Response:
        model = self.check_request(request, "/classify")
        request_id = self.new_request_id(raw_request)
        params = self.pooling_params(request_id, task="classify", use_activation=request.use_activation)
        prompts, field = await self.inputs(request, "classifies")
        finals = await self.embed(request_id, prompts, params, request, raw_request, in_field_words(field),
                                  what="classification")
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self._classified(request_id, model, finals))

    def _classified(self, request_id: str, model: str, finals: list[PoolingRequestOutput]) -> dict[str, Any]:
        """The ClassificationResponse as a plain dict (as /v1/embeddings builds its own)."""
        data = []
        labels: list[str] | None = None
        for index, final in enumerate(finals):
            probs = [float(value) for value in final.outputs.data.tolist()]
            if labels is None:
                labels = class_labels(self.engine.hf_config, len(probs))
            best = max(range(len(probs)), key=probs.__getitem__)  # the first of equal ones, as argmax
            data.append({"index": index, "label": labels[best], "probs": probs, "num_classes": len(probs)})
        prompt_tokens = sum(len(final.prompt_token_ids) for final in finals)
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}


def add_classify_routes(app: FastAPI, classify: OpenAIServingClassify,
                        error_responses: dict[int | str, dict[str, Any]]) -> None:
    """vLLM's path, outside /v1 (the API key guards it too: http_guards._GUARDED_PATHS)."""

    @app.post("/classify", response_model=ClassificationResponse, responses=error_responses)
    async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
        return await classify.create_classify(request, raw_request)
