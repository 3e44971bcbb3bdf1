"""`POST /v1/embeddings` on `sparrow serve --runner pooling`: one real server on 127.0.0.1, the real
`openai` client and langchain's OpenAIEmbeddings, each vector compared with HF transformers'
`AutoModel` on the same directory (the last token's final hidden state, L2-normalized: the pooler's
default), `usage` with the HF tokenizer's count.

The directory is an encoder checkpoint saved by `AutoModel` from a Qwen3 test model (architecture
`Qwen3Model`), its tokenizer appending `<|endoftext|>` as Qwen3-Embedding's does, so that
`add_special_tokens` changes what is embedded. The server declares it Matryoshka
(`--hf-overrides`), so that `dimensions` is served too. The generation endpoints on it, and this
one on a generative model, are 400s saying which kind of model is served.

vLLM's `/score` and `/rerank` on the same server (httpx: the openai client has no score API):
each score HF's cosine similarity of the pair's pooled vectors, in both pairings, the rerank
order and `top_n`, `usage` the HF tokenizer's count of the distinct texts.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import socket
import types

import httpx
import langchain_openai  # the dev extra's; a missing install fails here rather than skipping
import numpy as np
import openai
import pytest
import torch

from tests.conftest import build_test_model
from tests.test_server import API_KEY, MODEL_NAME, serve_for_module, wait_until

TEXTS = ["Hello, my name is", "The capital of France is " * 12, "a", "Once upon a time, in a land far away",
         "Hello, my name is"]  # the last one again: from the prefix cache
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ATOL = 1e-5


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, processors
    from transformers import AutoModel, AutoTokenizer

    root = tmp_path_factory.mktemp("embedding-model")
    build_test_model(root / "causal", arch="qwen3", preset="test", seed=11, tie_word_embeddings=False)
    encoder = root / "encoder"
    AutoModel.from_pretrained(root / "causal", dtype=torch.float32).save_pretrained(encoder)
    AutoTokenizer.from_pretrained(root / "causal").save_pretrained(encoder)
    tokenizer = Tokenizer.from_file(str(encoder / "tokenizer.json"))
    eos = "<|endoftext|>"
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, tokenizer.token_to_id(eos))])])
    tokenizer.save(str(encoder / "tokenizer.json"))
    return str(encoder)


@pytest.fixture(scope="module")
def server(encoder_dir, tmp_path_factory):
    yield from serve_for_module(encoder_dir, tmp_path_factory, "embeddings-logs", "--runner", "pooling",
                                "--hf-overrides", json.dumps({"is_matryoshka": True}))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def hf(encoder_dir):
    """(tokenizer, hidden): ``hidden(text or ids, add_special_tokens=True)`` is HF's final
    hidden states [len, hidden] of the input."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(encoder_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir)

    def hidden(prompt, add_special_tokens: bool = True) -> torch.Tensor:
        ids = tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids if isinstance(prompt, str) \
            else list(prompt)
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]

    return tokenizer, hidden


def normalized(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector, dim=0)


def assert_close(got, expected: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=ATOL), (got - expected).abs().max()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, headers=HEADERS, timeout=60)


def test_float_vectors_equal_hf_in_input_order(server, client, hf):
    tokenizer, hidden = hf
    prompt_tokens_before = server.metrics().get("sparrow:prompt_tokens_total", 0.0)
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert response.object == "list" and response.model == MODEL_NAME
    assert [item.index for item in response.data] == list(range(len(TEXTS)))
    for item, text in zip(response.data, TEXTS):
        assert item.object == "embedding"
        assert_close(item.embedding, normalized(hidden(text)[-1]))
    token_count = sum(len(tokenizer(text).input_ids) for text in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == token_count
    # The Prometheus prompt-token counter counts what was embedded (no token is ever generated).
    assert server.metrics()["sparrow:prompt_tokens_total"] - prompt_tokens_before == token_count
    # OpenAI's shape, key for key, with vLLM's id and created.
    body = post(server, {"model": MODEL_NAME, "input": "a"}).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("embd-") and isinstance(body["created"], int)
    assert set(body["data"][0]) == {"object", "embedding", "index"}
    assert body["usage"] == {"prompt_tokens": len(tokenizer("a").input_ids),
                             "total_tokens": len(tokenizer("a").input_ids)}


def test_the_chat_form_embeds_the_rendered_messages(server, hf):
    """vLLM's chat form: messages rendered with the model's chat template (no generation prompt,
    the template's own special tokens only) are one input, embedded as that text would be."""
    tokenizer, hidden = hf
    messages = [{"role": "system", "content": "You embed."}, {"role": "user", "content": "What is the capital?"}]
    for extra, generation_prompt in (({}, False), ({"add_generation_prompt": True}, True)):
        body = post(server, {"model": MODEL_NAME, "messages": messages, **extra}).json()
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        [item] = body["data"]
        assert_close(item["embedding"], normalized(hidden(ids)[-1]))
        assert body["usage"]["prompt_tokens"] == len(ids)
    # truncate_prompt_tokens keeps the rendered prompt's last tokens.
    body = post(server, {"model": MODEL_NAME, "messages": messages, "truncate_prompt_tokens": 5}).json()
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
    assert_close(body["data"][0]["embedding"], normalized(hidden(ids[-5:])[-1]))


def test_base64_is_little_endian_float32_as_the_openai_client_decodes_it(server, client):
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS[:3], encoding_format="float")
    # The openai client asks for base64 unless told otherwise, and decodes it.
    decoded = client.embeddings.create(model=MODEL_NAME, input=TEXTS[:3])
    raw = post(server, {"model": MODEL_NAME, "input": TEXTS[:3], "encoding_format": "base64"}).json()
    for plain, via_client, item in zip(floats.data, decoded.data, raw["data"]):
        assert via_client.embedding == plain.embedding
        assert np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist() == plain.embedding


def test_token_id_inputs(client, hf):
    tokenizer, hidden = hf
    ids = [tokenizer(text).input_ids for text in TEXTS[:3]]
    one = client.embeddings.create(model=MODEL_NAME, input=ids[1], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[1])
    assert_close(one.data[0].embedding, normalized(hidden(ids[1])[-1]))
    several = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    assert several.usage.prompt_tokens == sum(map(len, ids))
    for item, prompt in zip(several.data, ids):
        assert_close(item.embedding, normalized(hidden(prompt)[-1]))


def test_add_special_tokens_truncation_and_normalize_are_honoured(client, hf):
    tokenizer, hidden = hf
    text = TEXTS[3]
    bare = client.embeddings.create(model=MODEL_NAME, input=text, encoding_format="float",
                                    extra_body={"add_special_tokens": False})
    bare_ids = tokenizer(text, add_special_tokens=False).input_ids
    assert bare.usage.prompt_tokens == len(bare_ids) == len(tokenizer(text).input_ids) - 1
    assert_close(bare.data[0].embedding, normalized(hidden(text, add_special_tokens=False)[-1]))

    ids = tokenizer(TEXTS[1]).input_ids
    cut = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 5})
    assert cut.usage.prompt_tokens == 5
    assert_close(cut.data[0].embedding, normalized(hidden(ids[-5:])[-1]))

    raw = client.embeddings.create(model=MODEL_NAME, input=text, encoding_format="float",
                                   extra_body={"normalize": False})
    assert_close(raw.data[0].embedding, hidden(text)[-1])


def test_dimensions_on_a_matryoshka_model(server, client, hf):
    _, hidden = hf
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2], dimensions=16, encoding_format="float")
    for item, text in zip(response.data, TEXTS[:2]):
        assert len(item.embedding) == 16
        assert_close(item.embedding, normalized(hidden(text)[-1][:16]))
    decoded = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=16)  # base64
    assert decoded.data[0].embedding == response.data[0].embedding


def test_langchain_embed_documents(server, hf):
    _, hidden = hf
    embeddings = langchain_openai.OpenAIEmbeddings(model=MODEL_NAME, base_url=server.url + "/v1", api_key=API_KEY,
                                                   check_embedding_ctx_length=False, max_retries=0)
    vectors = embeddings.embed_documents(TEXTS[:3])
    assert len(vectors) == 3
    for vector, text in zip(vectors, TEXTS[:3]):
        assert_close(vector, normalized(hidden(text)[-1]))
    assert_close(embeddings.embed_query(TEXTS[3]), normalized(hidden(TEXTS[3])[-1]))


@pytest.mark.parametrize(("fields", "param", "phrase"), [
    ({"encoding_format": "bytes"}, "encoding_format", "'float' or 'base64'"),
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [[1, 2], []]}, "input", "input[1] is an empty list"),
    ({"input": ["a"] * 2049}, "input", "at most 2048 per request"),
    ({"input": [[1, 2], [3, "4"]]}, "input", "input[1][1]: Input should be a valid integer"),
    ({"input": [1, "2"]}, "input", "valid integer"),
    ({"bogus": 1}, "bogus", "unknown field"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "not both"),
    ({"add_generation_prompt": True}, "add_generation_prompt", "applies to the chat form"),
    ({"input": None, "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}, "chat_template",
     "--trust-request-chat-template"),
    ({"input": None, "messages": []}, "messages", "at least 1"),
    ({"input": None}, "input", "got neither"),
    ({"dimensions": 65}, "dimensions", "exceeds the model's 64"),
    ({"dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"dimensions": "8"}, "dimensions", "valid integer"),
    ({"input": [5000]}, "input", "token id 5000 is outside the model's vocabulary"),
    ({"input": ["ok", "word " * 600]}, "input", "tokens long; this model embeds at most 512"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"priority": 1}, "priority", "scheduler"),
    ({"add_special_tokens": 1}, "add_special_tokens", "valid boolean"),
])
def test_refusals_are_400s_naming_the_field(server, fields, param, phrase):
    response = post(server, {"model": MODEL_NAME, "input": "hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError" and error["param"] == param, error
    assert phrase in error["message"], error


def test_refusals_reach_the_openai_client_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError, match="exceeds the model's 64"):
        client.embeddings.create(model=MODEL_NAME, input="hi", dimensions=1000)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="hi")
    assert len(client.embeddings.create(model=MODEL_NAME, input="hi").data[0].embedding) == 64


def test_a_client_disconnect_aborts_every_input(server, client):
    """The client goes away once the engine has the inputs: those not yet embedded are aborted,
    and the server goes on."""
    def metric(name: str) -> float:
        return server.metrics().get(name, 0.0)

    aborted = 'sparrow:request_success_total{finished_reason="abort"}'
    aborted_before = metric(aborted)
    rng = random.Random(3)  # distinct inputs: nothing comes from the prefix cache
    body = json.dumps({"model": MODEL_NAME, "input": [[rng.randrange(4096) for _ in range(500)]
                                                      for _ in range(120)]}).encode()
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        wait_until(lambda: metric("sparrow:num_requests_running") + metric("sparrow:num_requests_waiting") > 0,
                   what="the inputs to reach the engine")
    wait_until(lambda: metric(aborted) > aborted_before and metric("sparrow:num_requests_running") == 0
               and metric("sparrow:num_requests_waiting") == 0, what="the inputs to be aborted")
    assert metric(aborted) - aborted_before <= 120
    assert len(client.embeddings.create(model=MODEL_NAME, input="hi").data) == 1


def test_generation_endpoints_say_the_model_is_an_embedding_model(server, client, hf):
    tokenizer, _ = hf
    calls = {
        "/v1/completions": lambda: client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2),
        "/v1/chat/completions": lambda: client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2),
        "/v1/responses": lambda: client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2),
    }
    for path, call in calls.items():
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        error = caught.value.body
        assert error["param"] == "model", error
        assert "is an embedding model" in error["message"] and "/v1/embeddings" in error["message"], error
        assert path in error["message"], error
    assert [model.id for model in client.models.list()] == [MODEL_NAME]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[0]}, headers=HEADERS).json()["tokens"]
    assert tokens == tokenizer(TEXTS[0]).input_ids


def hf_cosine(hidden, text_1: str, text_2: str) -> float:
    """The score vLLM's bi-encoder scoring gives a pair: the cosine similarity of HF's pooled,
    normalized vectors."""
    return float(normalized(hidden(text_1)[-1]) @ normalized(hidden(text_2)[-1]))


def post_to(server, path: str, body: dict, headers: dict | None = HEADERS) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_score_is_hf_cosine_similarity_one_to_many_and_pair_by_pair(server, hf):
    tokenizer, hidden = hf
    query, documents = TEXTS[3], [TEXTS[1], TEXTS[0], TEXTS[3]]  # the query again: a score of 1
    body = post_to(server, "/score", {"model": MODEL_NAME, "text_1": query, "text_2": documents}).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}, body
    assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == MODEL_NAME
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert all(set(item) == {"index", "object", "score"} and item["object"] == "score" for item in body["data"])
    for item, document in zip(body["data"], documents):
        assert abs(item["score"] - hf_cosine(hidden, query, document)) < ATOL, item
    assert abs(body["data"][2]["score"] - 1.0) < ATOL
    # Each distinct text embedded (and counted) once: the query is not embedded again per pair.
    distinct_tokens = sum(len(tokenizer(text).input_ids) for text in {query, *documents})
    assert body["usage"] == {"prompt_tokens": distinct_tokens, "total_tokens": distinct_tokens}

    # N -> N under vLLM's other names, on /v1/score; one string against one string.
    firsts, seconds = [TEXTS[0], TEXTS[2]], [TEXTS[3], TEXTS[0]]
    pairwise = post_to(server, "/v1/score", {"queries": firsts, "documents": seconds}).json()
    assert [item["index"] for item in pairwise["data"]] == [0, 1]
    for item, first, second in zip(pairwise["data"], firsts, seconds):
        assert abs(item["score"] - hf_cosine(hidden, first, second)) < ATOL, item
    assert pairwise["usage"]["prompt_tokens"] == sum(len(tokenizer(text).input_ids) for text in {*firsts, *seconds})
    single = post_to(server, "/score", {"data_1": TEXTS[0], "data_2": TEXTS[2], "truncate_prompt_tokens": 2}).json()
    ids = [tokenizer(text).input_ids[-2:] for text in (TEXTS[0], TEXTS[2])]
    expected = float(normalized(hidden(ids[0])[-1]) @ normalized(hidden(ids[1])[-1]))
    assert len(single["data"]) == 1 and abs(single["data"][0]["score"] - expected) < ATOL, single
    assert single["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_rerank_orders_documents_by_hf_cosine_similarity(server, hf):
    tokenizer, hidden = hf
    query = TEXTS[0]
    documents = [TEXTS[1], TEXTS[3], TEXTS[2], TEXTS[0], TEXTS[3]]  # a duplicate: the same score, in order
    expected = [hf_cosine(hidden, query, document) for document in documents]
    order = sorted(range(len(documents)), key=lambda index: expected[index], reverse=True)
    body = post_to(server, "/rerank", {"model": MODEL_NAME, "query": query, "documents": documents}).json()
    assert set(body) == {"id", "model", "usage", "results"} and body["id"].startswith("rerank-"), body
    assert [result["index"] for result in body["results"]] == order
    for result in body["results"]:
        assert set(result) == {"index", "document", "relevance_score"}, result
        assert result["document"] == {"text": documents[result["index"]]}
        assert abs(result["relevance_score"] - expected[result["index"]]) < ATOL, result
    distinct_tokens = sum(len(tokenizer(text).input_ids) for text in {query, *documents})
    assert body["usage"] == {"prompt_tokens": distinct_tokens, "total_tokens": distinct_tokens}
    # top_n cuts the ranking; return_documents false leaves the texts out (Jina's and Cohere's paths too).
    for path in ("/v1/rerank", "/v2/rerank"):
        top = post_to(server, path, {"query": query, "documents": documents, "top_n": 2,
                                     "return_documents": False}).json()
        assert [result["index"] for result in top["results"]] == order[:2], top
        assert all(set(result) == {"index", "relevance_score"} for result in top["results"]), top
        assert top["usage"] == body["usage"]
    assert len(post_to(server, "/rerank", {"query": query, "documents": documents[:2],
                                           "top_n": 9}).json()["results"]) == 2


@pytest.mark.parametrize(("path", "fields", "param", "phrase"), [
    ("/score", {"text_2": ["a", "b", "c"]}, "text_2", "text_2 has 3 texts and text_1 2"),
    ("/score", {"text_1": ["a", "b"], "text_2": "c"}, "text_2", "text_2 has 1 text and text_1 2"),
    ("/score", {"text_2": None}, "text_2", "text_2: missing"),
    ("/score", {"text_2": None, "documents": "b"}, "documents", "documents: does not go with text_1"),
    ("/score", {"text_1": []}, "text_1", "text_1 is empty"),
    ("/score", {"text_2": ["b", ""]}, "text_2", "text_2[1] is an empty string"),
    ("/score", {"text_2": [1]}, "text_2", "valid string"),
    ("/score", {"text_2": ["c", "word " * 600]}, "text_2", "this model embeds at most 512"),
    ("/score", {"use_activation": True}, "use_activation", "applies to a cross-encoder's outputs"),
    ("/score", {"mm_processor_kwargs": {}}, "mm_processor_kwargs", "not supported yet"),
    ("/v1/score", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ("/rerank", {"documents": []}, "documents", "documents is empty"),
    ("/rerank", {"query": ""}, "query", "query is an empty string"),
    ("/rerank", {"query": ["a"]}, "query", "valid string"),
    ("/rerank", {"top_n": -1}, "top_n", "greater than or equal to 0"),
    ("/v1/rerank", {"bogus": 1}, "bogus", "unknown field"),
    ("/v2/rerank", {"priority": 1}, "priority", "scheduler"),
])
def test_score_and_rerank_refusals_are_400s_naming_the_field(server, path, fields, param, phrase):
    base = {"text_1": ["a", "b"], "text_2": ["c", "d"]} if "score" in path else {"query": "a", "documents": ["b"]}
    response = post_to(server, path, {"model": MODEL_NAME, **base, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param, error
    assert phrase in error["message"], error


def test_score_and_rerank_outside_v1_need_the_api_key(server):
    for path, body in (("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v2/rerank", {"query": "a", "documents": ["b"]})):
        assert post_to(server, path, body, headers=None).status_code == 401, path


def test_a_generative_model_answers_embeddings_with_a_400():
    """The app over an engine without a pooler (a generative one; stubbed: the check reads only
    the input processor's ``pooling``)."""
    from sparrow.entrypoints.openai.api_server import build_app

    model_config = types.SimpleNamespace(generation_config="auto", override_generation_config={},
                                         reasoning_parser=None, max_model_len=512)
    engine = types.SimpleNamespace(
        served_model_name="generative", default_sampling_params={}, model_config=model_config, tokenizer=None,
        config=types.SimpleNamespace(lora=types.SimpleNamespace(enable_lora=False)),
        input_processor=types.SimpleNamespace(pooling=None, max_logprobs=20))
    app = build_app(engine)  # type: ignore[arg-type]

    calls = {"/v1/embeddings": {"input": "hi"}, "/score": {"text_1": "a", "text_2": "b"},
             "/v1/score": {"queries": "a", "documents": ["b"]}, "/rerank": {"query": "a", "documents": ["b"]},
             "/v1/rerank": {"query": "a", "documents": ["b"]}, "/v2/rerank": {"query": "a", "documents": ["b"]}}

    async def call() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return [await http.post(path, json={"model": "generative", **body}) for path, body in calls.items()]

    for path, response in zip(calls, asyncio.run(call())):
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == "model" and "is not an embedding model" in error["message"], error
        assert "--runner pooling" in error["message"], error
