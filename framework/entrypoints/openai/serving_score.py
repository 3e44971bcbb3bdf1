"""POST /score (and /v1/score) and POST /rerank (and /v1/rerank, /v2/rerank), vLLM's, on an
embedding model (``--runner pooling``): a pair's score is the cosine similarity of its two texts'
vectors, as vLLM scores with an embedding model and as ``LLM.score`` does offline. On a
cross-encoder (a classifier with one label) each pair is one prompt, its two texts tokenized
together (``tokenizer(text_1, text_pair=text_2)``, as ``LLM.score`` pairs them), and its score is
the classifier's output after its activation (sigmoid by default); ``usage`` counts every pair's
tokens, as vLLM does.

Pairs as vLLM forms them: one text against each text of the other side (1 -> N; a rerank's query
against its documents), or two lists of the same length side by side (N -> N). Each distinct text
of a request is embedded once (the query once, not once per document), through the engine
requests /v1/embeddings makes (``OpenAIServingEmbedding.embed``): every one checked and submitted
before the response is committed to, a client's disconnect aborting those not yet embedded.
``usage`` counts the tokens embedded, each distinct text once (vLLM counts a pair's two texts,
and a padding token between them, for every pair).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sparrow.entrypoints.llm_score import pair_token_ids
from sparrow.entrypoints.openai.protocol_score import (
    MAX_SCORE_TEXTS,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from sparrow.entrypoints.openai.request_checks import RequestFieldError, check_unicode
from sparrow.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, in_field_words, tokenize_one
from sparrow.entrypoints.openai.serving_engine import APIError, field_error

# (label, field, text): a distinct text of a request, named as the client first wrote it.
Text = tuple[str, str, str]


def side_texts(field: str, value: str | list[str]) -> list[tuple[str, str]]:
    """One side of the pairs as (label, text): ``field`` for a lone text, ``field[i]`` in a list."""
    if isinstance(value, str):
        return [(field, value)]
    if not value:
        raise RequestFieldError(f"{field} is empty; give at least one text", field)
    if len(value) > MAX_SCORE_TEXTS:
        raise RequestFieldError(f"{field} has {len(value)} texts; at most {MAX_SCORE_TEXTS} per request (send "
                                "several requests)", field)
    return [(f"{field}[{index}]", text) for index, text in enumerate(value)]


def pair_texts(first: tuple[str, str | list[str]], second: tuple[str, str | list[str]]
               ) -> tuple[list[Text], list[tuple[int, int]]]:
    """The distinct texts of both sides (``(field, value)`` each), in the order they first
    appear, and every pair as (index, index) into them, in the response's order."""
    (field_1, value_1), (field_2, value_2) = first, second
    side_1, side_2 = side_texts(field_1, value_1), side_texts(field_2, value_2)
    if len(side_1) != 1 and len(side_1) != len(side_2):
        texts_2 = f"{len(side_2)} text" + ("s" if len(side_2) > 1 else "")
        raise RequestFieldError(f"{field_2} has {texts_2} and {field_1} {len(side_1)}: a score pairs one text of "
                                f"{field_1} with every text of {field_2} (1 -> N), or two lists of the same length "
                                "text by text (N -> N)", field_2)
    seen: dict[str, int] = {}
    texts: list[Text] = []

    def index_of(label: str, field: str, text: str) -> int:
        if text not in seen:
            seen[text] = len(texts)
            texts.append((label, field, text))
        return seen[text]

    ids_1 = [index_of(label, field_1, text) for label, text in side_1]
    ids_2 = [index_of(label, field_2, text) for label, text in side_2]
    return texts, [(ids_1[0 if len(ids_1) == 1 else k], id_2) for k, id_2 in enumerate(ids_2)]


def tokenize_texts(input_processor: Any, request: ScoreRequest | RerankRequest, texts: list[Text]
                   ) -> list[dict[str, Any]]:
    """Every distinct text as an engine prompt, checked as /v1/embeddings checks a text input (the
    tokenizer's special tokens added). Blocking: run on the engine's input thread."""
    check_unicode(request)
    return [tokenize_one(input_processor, label, text, field=field, add_special_tokens=True,
                         truncate_prompt_tokens=request.truncate_prompt_tokens) for label, field, text in texts]


def side_pairs(first: tuple[str, str | list[str]], second: tuple[str, str | list[str]]
               ) -> list[tuple[Text, Text]]:
    """Every pair as its two texts, each named by its own side, in the response's order (once
    ``pair_texts`` has checked that the sides pair)."""
    (field_1, value_1), (field_2, value_2) = first, second
    side_1 = [(label, field_1, text) for label, text in side_texts(field_1, value_1)]
    side_2 = [(label, field_2, text) for label, text in side_texts(field_2, value_2)]
    return [(side_1[0 if len(side_1) == 1 else k], text_2) for k, text_2 in enumerate(side_2)]


def tokenize_pairs(input_processor: Any, request: ScoreRequest | RerankRequest, pairs: list[tuple[Text, Text]]
                   ) -> list[dict[str, Any]]:
    """Every pair as one cross-encoder prompt: both texts through the tokenizer at once, cut to
    ``truncate_prompt_tokens`` (the last k tokens, as the engine cuts a prompt) and checked to fit
    the model. Blocking: run on the engine's input thread."""
    check_unicode(request)
    for pair in pairs:
        for label, field, text in pair:
            if not text:
                raise RequestFieldError(f"{label} is an empty string; every text needs some", field)
    if input_processor.tokenizer is None:
        raise RequestFieldError("a cross-encoder tokenizes each pair of texts together, and this server has no "
                                "tokenizer (skip_tokenizer_init)", pairs[0][0][1])
    max_len = input_processor.max_model_len
    prompts = []
    for index, ((label_1, field_1, text_1), (label_2, field_2, text_2)) in enumerate(pairs):
        token_ids = input_processor.truncate(pair_token_ids(input_processor.tokenizer, text_1, text_2, index),
                                             request.truncate_prompt_tokens, max_len)
        if len(token_ids) > max_len:
            raise RequestFieldError(
                f"pair {index} ({label_1} with {label_2}) is {len(token_ids)} tokens long; this model reads a pair "
                f"as one input of at most {max_len} tokens (max_model_len); shorten it or set truncate_prompt_tokens",
                field_1 if len(text_1) > len(text_2) else field_2)
        prompts.append({"prompt_token_ids": token_ids})
    return prompts


class OpenAIServingScore(OpenAIServingEmbedding):
    """vLLM's score and rerank endpoints, on the embeddings endpoint's engine requests."""

    def check_pooling(self, model: str, endpoint: str = "/score") -> None:
        """An embedding model (bi-encoder) or a cross-encoder (a classifier with one label)."""
        pooling = self.engine.input_processor.pooling
        if pooling is None or pooling.head != "classify":
            super().check_pooling(model, endpoint)
        elif pooling.num_labels != 1:
            raise APIError(400, f"the model {model!r} is a classifier with {pooling.num_labels} labels: {endpoint} "
                           "needs an embedding model or a cross-encoder (a classifier with one label, whose output "
                           "is the pair's score); classify texts with /classify", "BadRequestError", param="model",
                           code="unsupported")

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        model = self.check_request(request, "/score")
        try:
            first, second = request.sides()
        except RequestFieldError as exc:
            raise field_error(exc) from None
        request_id = f"score-{uuid.uuid4().hex}"
        scored = await self._scores(request_id, request, raw_request, (first, getattr(request, first)),
                                    (second, getattr(request, second)))
        if scored is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        scores, prompt_tokens = scored
        return JSONResponse({
            "id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        model = self.check_request(request, "/rerank")
        request_id = f"rerank-{uuid.uuid4().hex}"
        scored = await self._scores(request_id, request, raw_request, ("query", request.query),
                                    ("documents", request.documents))
        if scored is None:
            return Response(status_code=499)
        scores, prompt_tokens = scored
        # Highest first; equal scores (the same document twice) in the documents' order.
        ranked = sorted(range(len(scores)), key=lambda index: scores[index], reverse=True)
        results = []
        for index in ranked[:request.top_n or len(ranked)]:
            result: dict[str, Any] = {"index": index}
            if request.return_documents:
                result["document"] = {"text": request.documents[index]}
            result["relevance_score"] = scores[index]
            results.append(result)
        return JSONResponse({"id": request_id, "model": model,
                             "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
                             "results": results})

    async def _scores(self, request_id: str, request: ScoreRequest | RerankRequest, raw_request: Request,
                      first: tuple[str, Any], second: tuple[str, Any]) -> tuple[list[float], int] | None:
        """Every pair's score, in order, and the tokens computed (None: the client went away)."""
        try:
            texts, pairs = pair_texts(first, second)
        except RequestFieldError as exc:
            raise field_error(exc) from None
        if self.engine.input_processor.pooling.head == "classify":
            return await self._cross_scores(request_id, request, raw_request, first[0], side_pairs(first, second))
        if request.use_activation is not None:
            raise field_error(RequestFieldError("use_activation: applies to a cross-encoder's outputs; this model is "
                                                "an embedding model, whose scores are cosine similarities",
                                                "use_activation"))
        params = self.pooling_params(request_id)
        prompts = await self.off_loop(tokenize_texts, self.engine.input_processor, request, texts,
                                      default_param=first[0])
        # An engine-side refusal of a prompt (all were checked above) names the first side's field.
        finals = await self.embed(request_id, prompts, params, request, raw_request, in_field_words(first[0]),
                                  labels=[label for label, _, _ in texts])
        if finals is None:
            return None
        import torch  # the vectors are torch tensors; as LLM.score computes it

        vectors = [final.outputs.data for final in finals]
        scores = [float(torch.nn.functional.cosine_similarity(vectors[i], vectors[j], dim=0)) for i, j in pairs]
        return scores, sum(len(final.prompt_token_ids) for final in finals)

    async def _cross_scores(self, request_id: str, request: ScoreRequest | RerankRequest, raw_request: Request,
                            first_field: str, pairs: list[tuple[Text, Text]]) -> tuple[list[float], int] | None:
        """A cross-encoder's score of every pair (one engine request each), and their tokens."""
        params = self.pooling_params(request_id, task="score", use_activation=request.use_activation)
        prompts = await self.off_loop(tokenize_pairs, self.engine.input_processor, request, pairs,
                                      default_param=first_field)
        labels = [f"pair {index} ({text_1[0]} with {text_2[0]})" for index, (text_1, text_2) in enumerate(pairs)]
        finals = await self.embed(request_id, prompts, params, request, raw_request, in_field_words(first_field),
                                  labels=labels, what="score")
        if finals is None:
            return None
        return ([float(final.outputs.data[0]) for final in finals],
                sum(len(final.prompt_token_ids) for final in finals))


def add_score_routes(app: FastAPI, scores: OpenAIServingScore,
                     error_responses: dict[int | str, dict[str, Any]]) -> None:
    """vLLM's paths for both endpoints. The schema lists each endpoint once, under /v1; the other
    paths are the same handlers (the API key guards them too: http_guards._GUARDED_PATHS)."""
    alias: dict[str, Any] = {"include_in_schema": False}

    @app.post("/v1/score", response_model=ScoreResponse, responses=error_responses)
    @app.post("/score", **alias)
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return await scores.create_score(request, raw_request)

    @app.post("/v1/rerank", response_model=RerankResponse, responses=error_responses)
    @app.post("/rerank", **alias)
    @app.post("/v2/rerank", **alias)
    async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
        return await scores.create_rerank(request, raw_request)

