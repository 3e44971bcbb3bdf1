"""The model's generation_config.json sets the default sampling parameters, as in vLLM
(``generation_config``, ``override_generation_config``), and ``max_logprobs`` bounds logprobs.

The reference is HF transformers: ``model.generate(input_ids)`` with no arguments applies the
same directory's generation_config.json (greedy with ``do_sample: false``, its
repetition_penalty and max_new_tokens), so Sparrow given no parameters must produce its tokens.
Real servers on 127.0.0.1 check the OpenAI endpoints' defaults, caps and limits."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError
from tests.test_server import API_KEY, MODEL_NAME, serve_for_module

# Greedy (temperature 0; do_sample false for HF), a repetition penalty strong enough to change the
# tokens, 12 new tokens; top_k/top_p/min_p are read too (greedy makes them moot for the tokens).
FILE_VALUES = {"do_sample": False, "temperature": 0.0, "repetition_penalty": 1.5, "max_new_tokens": 12,
               "top_k": 7, "top_p": 0.9, "min_p": 0.05}
PROMPTS = ["The cat sat on the", "Once upon a time there", "1 2 3 4 5 6 7 8"]


def write_generation_config(directory: Path, values: dict) -> None:
    path = directory / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(values)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from sparrow.tiny.model import build_model_dir

    directory = Path(build_model_dir(tmp_path_factory.mktemp("gen-config-model"), "qwen3", "test", seed=7))
    write_generation_config(directory, FILE_VALUES)
    return str(directory)


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_generate(hf, token_ids: list[int], **kwargs) -> list[int]:
    import torch

    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), **kwargs)
    return out[0, len(token_ids):].tolist()


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model=model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20) as engine:
        yield engine


# -- offline ----------------------------------------------------------------------------------
def test_get_default_sampling_params_reads_the_file(llm):
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.repetition_penalty, params.max_tokens) == (0.0, 1.5, 12)
    assert (params.top_k, params.top_p, params.min_p) == (7, 0.9, 0.05)
    # A fresh object each time: changing one does not change the defaults.
    params.max_tokens = 99
    assert llm.get_default_sampling_params().max_tokens == 12


def test_generate_without_params_equals_hf_generate_with_the_same_file(llm, hf):
    _, tokenizer = hf
    prompts = [{"prompt_token_ids": tokenizer(text).input_ids} for text in PROMPTS]
    outputs = llm.generate(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf_generate(hf, prompt["prompt_token_ids"])  # HF applies generation_config.json itself
        assert list(output.outputs[0].token_ids) == expected
    # The penalty matters here, so the defaults were really used: without it HF gives other tokens.
    plain = [hf_generate(hf, p["prompt_token_ids"], repetition_penalty=1.0) for p in prompts]
    assert plain != [list(o.outputs[0].token_ids) for o in outputs]
    # A SamplingParams the caller passes is used as it is (vLLM's rule): no penalty, 3 tokens.
    explicit = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in explicit] == [tokens[:3] for tokens in plain]


def test_chat_without_params_uses_the_defaults(llm):
    output = llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 12 or output.outputs[0].finish_reason == "stop"


def defaults_of(model_dir: str, **engine_args) -> dict:
    """The defaults an engine would use, built without starting one."""
    from sparrow.config import EngineConfig
    from sparrow.engine.generation_defaults import generation_defaults
    from sparrow.engine.setup import finalize_config

    return generation_defaults(finalize_config(EngineConfig.from_kwargs(model=model_dir, **engine_args)).model)


def test_generation_config_vllm_override_and_directory(model_dir, tmp_path):
    assert defaults_of(model_dir, generation_config="vllm") == {}
    assert defaults_of(model_dir, generation_config="vllm", override_generation_config={"temperature": 0.3}) == \
        {"temperature": 0.3}
    overridden = defaults_of(model_dir, override_generation_config={"repetition_penalty": 1.0, "max_new_tokens": 9})
    assert overridden == {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 9, "top_k": 7,
                          "top_p": 0.9, "min_p": 0.05}
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, {"temperature": 0.7, "top_p": 0.8, "eos_token_id": 3})
    assert defaults_of(model_dir, generation_config=str(other)) == {"temperature": 0.7, "top_p": 0.8}


def test_invalid_generation_configs_name_the_argument(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="generation_config.*has no generation_config.json"):
        defaults_of(model_dir, generation_config=str(tmp_path))
    with pytest.raises(ConfigError, match="override_generation_config.*'do_sample'"):
        defaults_of(model_dir, override_generation_config={"do_sample": True})
    with pytest.raises(ConfigError, match="override_generation_config.*temperature"):
        defaults_of(model_dir, override_generation_config={"temperature": -1.0})
    bad = tmp_path / "bad"
    bad.mkdir()
    write_generation_config(bad, {"top_p": 7.0})
    with pytest.raises(ConfigError, match="'generation_config'.*top_p"):
        defaults_of(model_dir, generation_config=str(bad))
    (bad / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.*JSON"):
        LLM(model=model_dir, generation_config=str(bad))


def test_max_logprobs(model_dir):
    with pytest.raises(ConfigError, match="max_logprobs"):
        LLM(model=model_dir, max_logprobs=-2)
    with LLM(model=model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20,
             max_logprobs=-1) as engine:
        vocab = engine.llm_engine.hf_config.vocab_size
        out = engine.generate("hello", SamplingParams(max_tokens=1, logprobs=vocab, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].logprobs[0]) == vocab
        with pytest.raises(ValueError, match=r"logprobs=.* exceeds the maximum of .*max_logprobs"):
            engine.generate("hello", SamplingParams(logprobs=vocab + 1), use_tqdm=False)


# -- the OpenAI server -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serve_for_module(model_dir, tmp_path_factory, "gen-config-logs")


@pytest.fixture(scope="module")
def capped_server(model_dir, tmp_path_factory):
    yield from serve_for_module(model_dir, tmp_path_factory, "gen-config-capped-logs",
                                "--override-generation-config", '{"max_new_tokens": 3, "repetition_penalty": 1.0}',
                                "--max-logprobs", "30")


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL_NAME, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def completion_ids(server, token_ids: list[int], **fields) -> list[int]:
    response = post(server, "/v1/completions", {"prompt": token_ids, "logprobs": 0,
                                                "return_tokens_as_token_ids": True, **fields})
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(token.removeprefix("token_id:")) for token in tokens]


def test_server_fills_unset_fields_from_the_file(server, hf):
    _, tokenizer = hf
    for text in PROMPTS:
        ids = tokenizer(text).input_ids
        # max_tokens null: the file's max_new_tokens; temperature, repetition_penalty: the file's.
        assert completion_ids(server, ids, max_tokens=None) == hf_generate(hf, ids)
        # A field the request sets wins over the file.
        assert completion_ids(server, ids, max_tokens=4, repetition_penalty=1.0) == \
            hf_generate(hf, ids, repetition_penalty=1.0, max_new_tokens=4)
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["usage"]["completion_tokens"] == 12 or chat["choices"][0]["finish_reason"] == "stop"


def test_server_default_max_tokens_is_cut_to_the_context(server, hf):
    # 510 prompt tokens leave 2 of max_model_len 512: the file's 12 is a default, so it is cut to 2.
    ids = [5] * 510
    response = post(server, "/v1/completions", {"prompt": ids, "max_tokens": None, "ignore_eos": True}).json()
    assert response["usage"]["completion_tokens"] == 2
    # Each prompt of a batch has its own room (as in vLLM): the short one gets the file's 12.
    response = post(server, "/v1/completions", {"prompt": [ids, [5] * 10], "max_tokens": None,
                                                "ignore_eos": True}).json()
    assert sorted(len(choice["text"]) > 0 for choice in response["choices"]) == [True, True]
    assert response["usage"]["completion_tokens"] == 2 + 12
    # A max_tokens the request asks for is not cut: it is a 400 naming it.
    refused = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_override_max_new_tokens_caps_every_request(capped_server, hf):
    _, tokenizer = hf
    ids = tokenizer(PROMPTS[0]).input_ids
    assert completion_ids(capped_server, ids, max_tokens=10) == hf_generate(hf, ids, repetition_penalty=1.0,
                                                                            max_new_tokens=3)
    chat = post(capped_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_completion_tokens": 50, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 3


def test_max_logprobs_bounds_the_server(server, capped_server):
    messages = [{"role": "user", "content": "hi"}]
    refused = post(server, "/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 21})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    assert "max_logprobs" in refused.json()["error"]["message"]
    allowed = post(capped_server, "/v1/chat/completions", {"messages": messages, "logprobs": True,
                                                           "top_logprobs": 25, "max_tokens": 1})
    assert allowed.status_code == 200, allowed.text
    assert len(allowed.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
    for path, body in (("/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 31}),
                       ("/v1/completions", {"prompt": "hi", "logprobs": 31}),
                       ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 31, "max_tokens": 1})):
        refused = post(capped_server, path, body)
        assert refused.status_code == 400, (path, refused.text)
        assert refused.json()["error"]["param"] in ("top_logprobs", "logprobs", "prompt_logprobs")
        assert "30" in refused.json()["error"]["message"]


def test_offline_default_max_tokens_is_cut_to_the_context(llm):
    # max_model_len 256: a 250-token prompt leaves 6 tokens, fewer than the file's 12. A default is
    # cut to fit (as the server and vLLM do); the same max_tokens asked for explicitly is refused.
    prompt = {"prompt_token_ids": [5] * 250}
    output = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    assert 1 <= len(output.token_ids) <= 6
    assert len(output.token_ids) == 6 or output.finish_reason == "stop"
    with pytest.raises(ValueError, match="max_tokens=12 is too large"):
        llm.generate(prompt, SamplingParams(max_tokens=12), use_tqdm=False)
