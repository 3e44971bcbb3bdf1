"""POST /score (and /v1/score) and POST /rerank (and /v1/rerank, /v2/rerank), vLLM's, on an
embedding model (``--runner pooling``): a pair's score is the cosine similarity of its two texts'
vectors, as vLLM scores with an embedding model and as ``LLM.score`` does offline.

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

from sparrow.entrypoints.openai.protocol_score import (
    MAX_SCORE_TEXTS,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from sparrow.entrypoints.openai.request_checks import RequestFieldError, check_unicode
from sparrow.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, in_field_words, tokenize_one
from sparrow.entrypoints.openai.serving_engine import field_error

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


class OpenAIServingScore(OpenAIServingEmbedding):
    """vLLM's score and rerank endpoints, on the embeddings endpoint's engine requests."""

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
        """Every pair's cosine similarity, in order, and the tokens embedded (None: the client went
        away)."""
        try:
            texts, pairs = pair_texts(first, second)
        except RequestFieldError as exc:
            raise field_error(exc) from None
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

