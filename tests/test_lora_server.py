"""LoRA adapters through a real ``sparrow serve`` on 127.0.0.1 and the real ``openai`` client: the
adapter name as the request's model, /v1/models, and vLLM's runtime load/unload endpoints."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from sparrow.tiny.lora import build_lora_adapter
from tests.test_server import API_KEY, MODEL_NAME, serve_for_module

PROMPT = "Once upon a time there was"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def adapter_dirs(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "first": str(build_lora_adapter(qwen3_dir, root / "first", rank=8, seed=11)),
        "second": str(build_lora_adapter(qwen3_dir, root / "second", rank=4, targets=("q_proj", "v_proj"), seed=12)),
        "too_big": str(build_lora_adapter(qwen3_dir, root / "too_big", rank=16, seed=13)),
    }


@pytest.fixture(scope="module")
def server(qwen3_dir, adapter_dirs, tmp_path_factory):
    second = json.dumps({"name": "second", "path": adapter_dirs["second"], "base_model_name": MODEL_NAME})
    previous = os.environ.get("SPARROW_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["SPARROW_ALLOW_RUNTIME_LORA_UPDATING"] = "true"  # inherited by the server process
    try:
        yield from serve_for_module(qwen3_dir, tmp_path_factory, "lora-server", "--enable-lora", "--max-loras", "2",
                                    "--max-lora-rank", "8", "--dtype", "float32",
                                    "--lora-modules", f"first={adapter_dirs['first']}", second)
    finally:
        if previous is None:
            os.environ.pop("SPARROW_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["SPARROW_ALLOW_RUNTIME_LORA_UPDATING"] = previous


def complete(server, model: str) -> list[int]:
    """Greedy token ids (as logprob labels) of PROMPT under ``model``."""
    result = server.client().completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                                logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                                        "ignore_eos": True})
    return result.choices[0].logprobs.tokens


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=30)


def test_models_lists_the_adapters_with_their_base_model(server, adapter_dirs, qwen3_dir):
    cards = {card.id: card for card in server.client().models.list().data}
    assert list(cards) == [MODEL_NAME, "first", "second"]
    for name in ("first", "second"):
        card = cards[name].model_dump()
        assert card["root"] == adapter_dirs[name] and card["parent"] == MODEL_NAME
    assert server.client().models.retrieve("first").id == "first"


def test_the_model_name_selects_the_adapter(server):
    base, first, second = (complete(server, model) for model in (MODEL_NAME, "first", "second"))
    assert len({tuple(base), tuple(first), tuple(second)}) == 3
    assert complete(server, "first") == first  # deterministic, and the slots keep their adapters
    chat = server.client().chat.completions.create(model="second", max_tokens=4, temperature=0.0,
                                                   messages=[{"role": "user", "content": PROMPT}])
    assert chat.model == "second" and chat.choices[0].message.content is not None


def test_unknown_model_is_a_404_in_vllm_shape(server):
    with pytest.raises(openai.NotFoundError) as info:
        complete(server, "no-such-adapter")
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_load_and_unload_at_runtime(server, adapter_dirs):
    first = complete(server, "first")
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": adapter_dirs["first"]})
    assert response.status_code == 200, response.text
    assert "third" in [card.id for card in server.client().models.list().data]
    assert complete(server, "third") == first  # the same weights under another name
    response = post(server, "/v1/unload_lora_adapter", {"lora_name": "third"})
    assert response.status_code == 200, response.text
    assert "third" not in [card.id for card in server.client().models.list().data]
    with pytest.raises(openai.NotFoundError):
        complete(server, "third")
    assert complete(server, "first") == first


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": "{first}"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "{too_big}"}, 400, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name"),
])
def test_adapter_endpoint_errors_name_the_field(server, adapter_dirs, path, body, status, param):
    body = {key: value.format(**adapter_dirs) for key, value in body.items()}
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    if body.get("lora_path") == adapter_dirs["too_big"]:
        assert "max_lora_rank=8" in error["message"]
    assert "x" not in [card.id for card in server.client().models.list().data]


def test_runtime_endpoints_do_not_exist_without_the_variable(qwen3_dir, adapter_dirs, tmp_path_factory,
                                                             monkeypatch):
    """vLLM's rule: without the variable a client cannot make the server read a path of its choice."""
    monkeypatch.delenv("SPARROW_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    lifetime = serve_for_module(qwen3_dir, tmp_path_factory, "lora-no-runtime", "--enable-lora", "--max-lora-rank",
                                "8", "--dtype", "float32", "--lora-modules", f"first={adapter_dirs['first']}")
    server = next(lifetime)
    try:
        load = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapter_dirs["second"]})
        unload = post(server, "/v1/unload_lora_adapter", {"lora_name": "first"})
        assert (load.status_code, unload.status_code) == (404, 404), (load.text, unload.text)
        assert [card.id for card in server.client().models.list().data] == [MODEL_NAME, "first"]
        assert complete(server, "first") != complete(server, MODEL_NAME)  # the flag's adapter still serves
    finally:
        for _ in lifetime:  # stops the server and checks that it exited cleanly
            pass
