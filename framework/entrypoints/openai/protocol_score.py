"""Request and response bodies of vLLM's ``POST /score`` and ``POST /rerank`` (Jina's and Cohere's
rerank shape), served here as vLLM serves them: from an embedding model each pair's score is the
cosine similarity of its two texts' vectors (bi-encoder scoring), from a cross-encoder (a
classifier with one label) the classifier's output on both texts read together.

As the other request models (``protocol``): strict JSON types, and unknown fields kept only so
that ``request_checks`` can refuse each one with a 400 naming it. A cross-encoder's
``use_activation`` is taken (false: the raw logit), and refused on an embedding model's cosine
scores; vLLM's deprecated spellings of it (``softmax``, ``activation``) and its multimodal inputs
are among the fields refused.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from sparrow.entrypoints.openai.protocol import INT32_MAX, INT64_MAX, OpenAIBaseModel, RequestModel
from sparrow.entrypoints.openai.protocol_embeddings import MAX_EMBEDDING_INPUTS, EmbeddingUsage
from sparrow.entrypoints.openai.request_checks import RequestFieldError

# At most this many texts in each list of a request: each distinct text is one engine request.
MAX_SCORE_TEXTS = MAX_EMBEDDING_INPUTS

# The names vLLM's ScoreRequest gives the two sides (ScoreTextRequest, ScoreQueriesDocumentsRequest,
# ScoreQueriesItemsRequest, ScoreDataRequest): a request uses one pair.
SCORE_FIELD_PAIRS: tuple[tuple[str, str], ...] = (
    ("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
_SCORE_FIELDS = ("text_1", "text_2", "queries", "documents", "items", "data_1", "data_2")
_PAIRS_TEXT = ("text_1 and text_2 (or vLLM's other names for them: queries and documents, queries and items, "
               "data_1 and data_2)")

_TEXTS = (f"A text or a list of texts (at most {MAX_SCORE_TEXTS}); one text is scored against every text of the "
          "other side (1 -> N), two lists of the same length pair by pair (N -> N).")


class _ScoringFields(RequestModel):
    model: str | None = Field(None, description="Served model name; defaults to the first one served.")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=INT32_MAX,
        description="Keep only each text's last k tokens (-1: the most the model takes, max_model_len).")
    priority: int = Field(0, ge=-INT64_MAX, le=INT64_MAX,
                          description="vLLM's: the scheduling priority (needs a priority scheduler).")
    user: str | None = Field(None, description="An end-user id; accepted, as the other endpoints accept it.")
    use_activation: bool | None = Field(
        None, description="A cross-encoder's activation (sigmoid) over its logit (false: the raw logit; null: the "
        "model's pooler default); not for an embedding model's cosine scores.")


class ScoreRequest(_ScoringFields):
    text_1: str | list[str] | None = Field(None, description="The first side. " + _TEXTS)
    text_2: str | list[str] | None = Field(None, description="The second side. " + _TEXTS)
    queries: str | list[str] | None = Field(None, description="vLLM's other name for text_1.")
    documents: str | list[str] | None = Field(None, description="vLLM's other name for text_2 (with queries).")
    items: str | list[str] | None = Field(None, description="vLLM's other name for text_2 (with queries).")
    data_1: str | list[str] | None = Field(None, description="vLLM's other name for text_1.")
    data_2: str | list[str] | None = Field(None, description="vLLM's other name for text_2.")

    def sides(self) -> tuple[str, str]:
        """The pair of fields this request gives its texts in (``text_1``, ``text_2``, ...); a
        RequestFieldError naming the field that is missing or does not belong."""
        given = [name for name in _SCORE_FIELDS if getattr(self, name) is not None]
        for pair in SCORE_FIELD_PAIRS:
            if sorted(given) == sorted(pair):
                return pair
        if not given:
            raise RequestFieldError(f"text_1: missing; a score request gives its texts in {_PAIRS_TEXT}", "text_1")
        anchor = given[0]
        pairs = [pair for pair in SCORE_FIELD_PAIRS if anchor in pair]
        partners = [name for pair in pairs for name in pair if name != anchor]
        for name in given[1:]:
            if name not in partners:
                raise RequestFieldError(f"{name}: does not go with {anchor}; a score request gives its texts in one "
                                        f"pair of fields: {_PAIRS_TEXT}", name)
        if len(given) > 2:
            raise RequestFieldError(f"{given[2]}: give {anchor} with {' or '.join(partners)}, not both",
                                    given[2])
        raise RequestFieldError(f"{partners[0]}: missing; {anchor} is scored against {' or '.join(partners)}",
                                partners[0])


class RerankRequest(_ScoringFields):
    query: str = Field(..., description="The text the documents are ranked against.")
    documents: list[str] = Field(..., description=f"The texts to rank (at most {MAX_SCORE_TEXTS}), none empty.")
    top_n: int | None = Field(
        None, ge=0, le=INT32_MAX, description="Return the n best documents only (0 or null: all of them).")
    return_documents: bool = Field(
        True, description="Each result carries its document's text (false: only its index and score).")


class ScoreResponseData(OpenAIBaseModel):
    index: int  # the pair's position: the position of its text of the second side (1 -> N), or of both
    object: Literal["score"] = "score"
    score: float  # the cosine similarity of the pair's vectors, in [-1, 1]; a cross-encoder's output


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: EmbeddingUsage  # the tokens embedded, each distinct text once (a cross-encoder: every pair's)


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int  # the document's position in the request
    document: RerankDocument | None = None  # absent with return_documents false
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # highest score first, cut to top_n
