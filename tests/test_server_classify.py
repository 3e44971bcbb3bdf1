"""vLLM's `POST /classify`, and `/score` and `/rerank` on a cross-encoder, on `sparrow serve`: two
real servers on 127.0.0.1 (httpx: the openai client has no classify or score API), each result
compared with HF transformers' `AutoModelForSequenceClassification` on the same directory.

The directories are those tests/test_classify.py builds (`save_classifier`): a Qwen3 test model
saved by transformers as `Qwen3ForSequenceClassification`, a three-label classifier (its
config.json naming its labels) and a one-label cross-encoder, each served by its architecture
alone (no `--runner`). The classifier's probabilities are HF's softmax of its logits; the
cross-encoder's scores HF's sigmoid of the pair's logit, the pair tokenized together
(`tokenizer(text_1, text_pair=text_2)`). Refusals are 400s naming the field, after which the
engine still serves; the endpoints that do not fit a model (`/v1/embeddings` on a classifier,
`/score` on a three-label one, `/classify` on an embedding or a generative model) are 400s naming
`model`.
"""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.conftest import build_test_model
from tests.test_classify import save_classifier
from tests.test_server import API_KEY, MODEL_NAME, serve_for_module

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["Hello, my name is", "The capital of France is " * 9, "a", "Once upon a time, in a land far away"]
QUERY = "what is the capital of France"
DOCUMENTS = ["Paris is the capital of France", "a cat", "Once upon a time", "Paris is the capital of France"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-classify")
    causal = build_test_model(root / "causal", arch="qwen3", preset="test", seed=11, tie_word_embeddings=False)
    classifier = save_classifier(causal, root / "classifier", 3, seed=1)
    config_path = Path(classifier) / "config.json"
    config = json.loads(config_path.read_text())
    config["id2label"] = {str(index): label for index, label in LABELS.items()}
    config["label2id"] = {label: index for index, label in LABELS.items()}
    config_path.write_text(json.dumps(config))
    return {"classifier": classifier, "cross": save_classifier(causal, root / "cross", 1, seed=2)}


@pytest.fixture(scope="module")
def classifier(dirs, tmp_path_factory):
    yield from serve_for_module(dirs["classifier"], tmp_path_factory, "classifier-logs")


@pytest.fixture(scope="module")
def cross(dirs, tmp_path_factory):
    yield from serve_for_module(dirs["cross"], tmp_path_factory, "cross-encoder-logs")


def hf_reference(model_dir: str):
    """(tokenizer, logits): ``logits(text or token ids)`` is HF's logits [num_labels]."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def logits(prompt) -> torch.Tensor:
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0]

    return tokenizer, logits


def post(server, path: str, body: dict, headers: dict | None = HEADERS) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def assert_close(got, expected: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.allclose(got, expected, atol=ATOL), (got - expected).abs().max()


def assert_refused(response: httpx.Response, param: str, phrase: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param, error
    assert phrase in error["message"], error


def test_classify_is_hf_softmax_with_the_checkpoints_labels(classifier, dirs):
    tokenizer, logits = hf_reference(dirs["classifier"])
    body = post(classifier, "/classify", {"model": MODEL_NAME, "input": TEXTS}).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}, body
    assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == MODEL_NAME
    assert isinstance(body["created"], int)
    assert [item["index"] for item in body["data"]] == list(range(len(TEXTS)))
    for item, text in zip(body["data"], TEXTS):
        assert set(item) == {"index", "label", "probs", "num_classes"} and item["num_classes"] == 3, item
        expected = torch.softmax(logits(text), dim=-1)
        assert_close(item["probs"], expected)
        assert item["label"] == LABELS[int(expected.argmax())], item
    tokens = sum(len(tokenizer(text).input_ids) for text in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                             "prompt_tokens_details": None}

    # Token ids, the raw logits, and truncation (the last k tokens, counted in usage).
    ids = tokenizer(TEXTS[1]).input_ids
    raw = post(classifier, "/classify", {"input": [ids, ids[:4]], "use_activation": False}).json()
    assert_close(raw["data"][0]["probs"], logits(ids))
    assert_close(raw["data"][1]["probs"], logits(ids[:4]))
    assert raw["data"][0]["label"] == LABELS[int(logits(ids).argmax())]
    cut = post(classifier, "/classify", {"input": TEXTS[1], "truncate_prompt_tokens": 5, "user": "u"}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert_close(cut["data"][0]["probs"], torch.softmax(logits(ids[-5:]), dim=-1))


@pytest.mark.parametrize(("fields", "param", "phrase"), [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["a"] * 2049}, "input", "at most 2048 per request"),
    ({"input": [5000]}, "input", "token id 5000 is outside the model's vocabulary"),
    ({"input": ["ok", "word " * 600]}, "input", "tokens long; this model classifies at most 512"),
    ({"use_activation": "yes"}, "use_activation", "valid boolean"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"priority": 1}, "priority", "scheduler"),
    ({"softmax": False}, "softmax", "unknown field"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "not both"),
    ({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs", "applies to the chat form"),
    ({"dimensions": 2}, "dimensions", "unknown field"),
])
def test_classify_refusals_are_400s_naming_the_field(classifier, fields, param, phrase):
    assert_refused(post(classifier, "/classify", {"model": MODEL_NAME, "input": "hi", **fields}), param, phrase)


def test_the_chat_form_classifies_the_rendered_messages(classifier, dirs):
    tokenizer, logits = hf_reference(dirs["classifier"])
    messages = [{"role": "user", "content": "Is this review positive?"}]
    body = post(classifier, "/classify", {"model": MODEL_NAME, "messages": messages}).json()
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
    [item] = body["data"]
    assert_close(item["probs"], torch.softmax(logits(ids), dim=-1))
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_pooling_gives_any_task_of_the_classifier_as_numbers_or_base64(classifier, dirs):
    from tests.test_classify import hf_token_logits

    tokenizer, logits = hf_reference(dirs["classifier"])
    token_logits = hf_token_logits(dirs["classifier"])
    # The default task is the model's first (classify): LLM.encode over HTTP.
    body = post(classifier, "/pooling", {"model": MODEL_NAME, "input": TEXTS[:2]}).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"} and body["id"].startswith("pool-")
    for index, (item, text) in enumerate(zip(body["data"], TEXTS)):
        assert item["index"] == index and item["object"] == "pooling", item
        assert_close(item["data"], torch.softmax(logits(text), dim=-1))
    tokens = sum(len(tokenizer(text).input_ids) for text in TEXTS[:2])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    # token_classify (vLLM's reward output): a row per prompt token; the raw logits; base64 float32 rows.
    ids = tokenizer(TEXTS[1]).input_ids
    [item] = post(classifier, "/pooling", {"input": TEXTS[1], "task": "token_classify"}).json()["data"]
    assert_close(item["data"], torch.softmax(token_logits(ids), dim=-1))
    [raw] = post(classifier, "/pooling", {"input": ids, "task": "encode", "use_activation": False,
                                          "encoding_format": "base64"}).json()["data"]
    import base64

    import numpy as np
    decoded = np.frombuffer(base64.b64decode(raw["data"]), dtype="<f4").reshape(len(ids), 3)
    assert_close(decoded.tolist(), token_logits(ids))
    # Fields for another task, and tasks the model does not have, are 400s naming the field.
    for fields, param in (({"task": "token_embed"}, "task"), ({"task": "score"}, "task"), ({"task": "x"}, "task"),
                          ({"normalize": True}, "normalize"), ({"dimensions": 2}, "dimensions")):
        response = post(classifier, "/pooling", {"input": "hi", **fields})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert post(classifier, "/pooling", {"input": "hi"}, headers=None).status_code == 401


def rounded(value):
    """``value`` with every float rounded to 5 decimals (JSON: dicts, lists, numbers, strings)."""
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


def test_invocations_routes_pooling_bodies_to_their_endpoints(classifier, cross):
    for server, body, path in ((classifier, {"input": TEXTS[:2]}, "/classify"),
                               (classifier, {"input": TEXTS[0], "task": "token_classify"}, "/pooling"),
                               (cross, {"text_1": QUERY, "text_2": DOCUMENTS}, "/score"),
                               (cross, {"query": QUERY, "documents": DOCUMENTS}, "/rerank")):
        routed, direct = post(server, "/invocations", body).json(), post(server, path, body).json()
        for reply in (routed, direct):
            reply.pop("id"), reply.pop("created", None)
        assert rounded(routed) == rounded(direct), path  # batched differently: float32 rounding apart
    assert post(classifier, "/invocations", {"prompt": "hi"}).status_code == 400


def test_endpoints_that_need_another_model_name_it_and_the_classifier_goes_on(classifier):
    assert_refused(post(classifier, "/v1/embeddings", {"input": "hi"}), "model", "is a classifier (3 labels)")
    for path, body in (("/score", {"text_1": "a", "text_2": "b"}), ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        assert_refused(post(classifier, path, body), "model", "is a classifier with 3 labels")
    with pytest.raises(openai.BadRequestError) as caught:
        classifier.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert caught.value.body["param"] == "model" and "is a classifier" in caught.value.body["message"]
    assert "/classify" in caught.value.body["message"]
    assert post(classifier, "/classify", {"input": "hi"}, headers=None).status_code == 401
    assert post(classifier, "/classify", {"model": "another", "input": "hi"}).status_code == 404
    assert post(classifier, "/classify", {"input": "hi"}).json()["data"][0]["num_classes"] == 3


def test_cross_encoder_scores_are_hf_sigmoid_of_each_pair_read_together(cross, dirs):
    tokenizer, logits = hf_reference(dirs["cross"])

    def pair_ids(first: str, second: str) -> list[int]:
        return tokenizer(first, text_pair=second).input_ids

    def expected(first: str, second: str) -> float:
        return float(torch.sigmoid(logits(pair_ids(first, second)))[0])

    body = post(cross, "/score", {"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"} and body["id"].startswith("score-")
    assert [item["index"] for item in body["data"]] == list(range(len(DOCUMENTS)))
    for item, document in zip(body["data"], DOCUMENTS):
        assert abs(item["score"] - expected(QUERY, document)) < ATOL, item
    # Every pair is one prompt: the query is counted in each.
    tokens = sum(len(pair_ids(QUERY, document)) for document in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    firsts, seconds = DOCUMENTS[:2], [QUERY, DOCUMENTS[2]]
    pairwise = post(cross, "/v1/score", {"queries": firsts, "documents": seconds, "truncate_prompt_tokens": 6}).json()
    for item, first, second in zip(pairwise["data"], firsts, seconds):
        assert abs(item["score"] - float(torch.sigmoid(logits(pair_ids(first, second)[-6:]))[0])) < ATOL, item
    assert pairwise["usage"]["prompt_tokens"] == 12

    # /rerank: best first (the duplicate document in the documents' order), top_n, on every path.
    scores = [expected(QUERY, document) for document in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda index: scores[index], reverse=True)
    ranked = post(cross, "/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert [result["index"] for result in ranked["results"]] == order, ranked
    for result in ranked["results"]:
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert abs(result["relevance_score"] - scores[result["index"]]) < ATOL, result
    assert ranked["usage"] == body["usage"]
    for path in ("/v1/rerank", "/v2/rerank"):
        top = post(cross, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False})
        assert [result["index"] for result in top.json()["results"]] == order[:2], top.text
    # use_activation false: the raw logit, on both endpoints.
    raw = post(cross, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[:1], "use_activation": False}).json()
    assert abs(raw["data"][0]["score"] - float(logits(pair_ids(QUERY, DOCUMENTS[0]))[0])) < ATOL, raw
    [top] = post(cross, "/rerank", {"query": QUERY, "documents": DOCUMENTS[:1], "use_activation": False}
                 ).json()["results"]
    assert abs(top["relevance_score"] - float(logits(pair_ids(QUERY, DOCUMENTS[0]))[0])) < ATOL, top

    # /classify on a cross-encoder: the sigmoid of its one logit.
    [item] = post(cross, "/classify", {"input": TEXTS[0]}).json()["data"]
    assert item["num_classes"] == 1 and item["label"] == "LABEL_0"
    assert_close(item["probs"], torch.sigmoid(logits(TEXTS[0])))


@pytest.mark.parametrize(("path", "fields", "param", "phrase"), [
    ("/score", {"text_2": ["b", ""]}, "text_2", "text_2[1] is an empty string"),
    ("/score", {"text_1": ""}, "text_1", "text_1 is an empty string"),
    ("/score", {"text_2": ["b", "word " * 600]}, "text_2", "pair 1 (text_1 with text_2[1]) is"),
    ("/score", {"text_2": ["a", "b", "c"], "text_1": ["a", "b"]}, "text_2", "text_2 has 3 texts and text_1 2"),
    ("/score", {"use_activation": "no"}, "use_activation", "valid boolean"),
    ("/score", {"softmax": False}, "softmax", "unknown field"),
    ("/rerank", {"documents": []}, "documents", "documents is empty"),
    ("/v1/rerank", {"query": "word " * 600}, "query", "this model reads a pair as one input of at most 512"),
])
def test_cross_encoder_refusals_are_400s_naming_the_field(cross, path, fields, param, phrase):
    base = {"text_1": "a", "text_2": ["b", "c"]} if "score" in path else {"query": "a", "documents": ["b"]}
    assert_refused(post(cross, path, {"model": MODEL_NAME, **base, **fields}), param, phrase)


def test_a_cross_encoder_refuses_embeddings_and_goes_on_scoring(cross):
    assert_refused(post(cross, "/v1/embeddings", {"input": "hi"}), "model", "is a classifier (1 label)")
    assert len(post(cross, "/score", {"text_1": "a", "text_2": ["b", "c"]}).json()["data"]) == 2


def test_classify_on_an_embedding_or_a_generative_model_is_a_400_naming_model():
    """The app over stub engines (the checks read only the input processor's ``pooling``)."""
    from sparrow.entrypoints.openai.api_server import build_app

    model_config = types.SimpleNamespace(generation_config="auto", override_generation_config={},
                                         reasoning_parser=None, max_model_len=512)

    def engine(pooling):
        return types.SimpleNamespace(
            served_model_name="m", default_sampling_params={}, model_config=model_config, tokenizer=None,
            config=types.SimpleNamespace(lora=types.SimpleNamespace(enable_lora=False)),
            input_processor=types.SimpleNamespace(pooling=pooling, max_logprobs=20))

    async def classify(pooling) -> httpx.Response:
        app = build_app(engine(pooling))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return await http.post("/classify", json={"input": "hi"})

    embedding = types.SimpleNamespace(head="embed", num_labels=None, supported_tasks=("embed", "token_embed"))
    assert_refused(asyncio.run(classify(embedding)), "model", "is an embedding model")
    token_classifier = types.SimpleNamespace(head="classify", num_labels=4, supported_tasks=("token_classify",))
    assert_refused(asyncio.run(classify(token_classifier)), "model", "is a token classifier (4 labels): it answers "
                   "/pooling (task token_classify)")
    assert_refused(asyncio.run(classify(None)), "model", "is not a classifier")
