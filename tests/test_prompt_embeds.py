"""vLLM's prompt embeddings (enable_prompt_embeds): prompts given as ``{"prompt_embeds": tensor}``
offline and as base64 ``torch.save``'d tensors in ``/v1/completions``' ``prompt_embeds``.

References are HF transformers on the same directories: the model's own embeddings of a token
prompt must give that prompt's tokens, and random embeddings the tokens and logprobs of HF's
``model(inputs_embeds=...)`` decoded greedily (fp32, within 1e-3), through chunked prefill, the
prefix cache (keyed by the embeddings, never by the placeholder ids) and preemption. A repetition
penalty counts the generated tokens only (the prompt has no token ids). Refusals name the field and
leave the engine serving.
"""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError
from sparrow.errors import InvalidArgumentError
from tests.conftest import build_test_model
from tests.test_server import API_KEY, MODEL_NAME, serve_for_module

ATOL = 1e-3
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
GEMMA2 = dict(arch="gemma2", hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
              intermediate_size=80, vocab_size=512, sliding_window=12, query_pre_attn_scalar=24,
              attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True)


# KV caches of 8-slot blocks too small for the batch (Gemma 2's sliding layers need fewer blocks).
PREEMPTING_BLOCKS = {"llama": 10, "gemma2": 14}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prompt-embeds")
    return {"llama": build_test_model(root / "llama", arch="llama", seed=3),
            "gemma2": build_test_model(root / "gemma2", seed=4, **GEMMA2)}


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True)
    return model.eval()


def hf_greedy_from_embeds(model, embeds: torch.Tensor, max_tokens: int = MAX_TOKENS,
                          repetition_penalty: float = 1.0) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy decoding from ``inputs_embeds`` (each new token embedded by the model), with a
    repetition penalty over the generated tokens only; the logprobs are of the raw logits."""
    inputs, tokens, logprobs = embeds[None], [], []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(inputs_embeds=inputs).logits[0, -1].float()
            logprobs.append(logits.log_softmax(-1))
            scored = logits.clone()
            if tokens and repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(tokens)))
                values = scored[seen]
                scored[seen] = torch.where(values > 0, values / repetition_penalty, values * repetition_penalty)
            token = int(scored.argmax())
            tokens.append(token)
            inputs = torch.cat([inputs, model.get_input_embeddings()(torch.tensor([[token]]))], dim=1)
    return tokens, logprobs


def engine(model_dir: str, **overrides) -> LLM:
    kwargs = dict(multiprocess=False, dtype="float32", max_model_len=128, enable_chunked_prefill=True,
                  max_num_batched_tokens=16, enable_prefix_caching=True, block_size=8, enable_prompt_embeds=True)
    return LLM(model_dir, **{**kwargs, **overrides})


def random_embeds(num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5


def check_against_hf(output, reference) -> None:
    tokens, hf_logprobs = reference
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert abs(position[token].logprob - hf_logprobs[step][token].item()) < ATOL, f"step {step}"


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_embeddings_generate_as_hf_and_as_the_tokens_they_embed(name, dirs):
    """Random embeddings of 3, 13 and 40 positions (chunks of 16, blocks of 8) decode as HF does
    from inputs_embeds, twice (the second time from the prefix cache); the model's embeddings of
    a token prompt decode as that prompt; a KV cache too small for the batch preempts them and
    they still do."""
    model = hf_model(dirs[name])
    hidden = model.config.hidden_size
    embeds = [random_embeds(n, hidden, seed=n) for n in (3, 13, 40)]
    references = [hf_greedy_from_embeds(model, e) for e in embeds]
    token_prompt = [5, 17, 99, 3, 42, 8, 11, 23, 61, 7, 2, 19, 33, 4, 6, 9, 10]
    own = model.get_input_embeddings()(torch.tensor(token_prompt)).detach()
    llm = engine(dirs[name])
    try:
        for attempt in range(2):
            outputs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
            for output, reference in zip(outputs, references):
                check_against_hf(output, reference)
                assert output.prompt_token_ids is None and output.prompt is None
            assert [o.prompt_length for o in outputs] == [3, 13, 40]
            if attempt == 1:  # full blocks of the same embeddings are shared
                assert [o.num_cached_tokens for o in outputs] == [0, 8, 32]
        by_ids, by_embeds = llm.generate([{"prompt_token_ids": token_prompt}, {"prompt_embeds": own}], GREEDY,
                                         use_tqdm=False)
        assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
        assert by_embeds.outputs[0].text == by_ids.outputs[0].text
        assert by_embeds.num_cached_tokens == 0, "embeddings must not hit the blocks of token ids"
    finally:
        llm.shutdown()
    llm = engine(dirs[name], num_kv_blocks=PREEMPTING_BLOCKS[name])
    try:
        outputs = llm.generate([{"prompt_embeds": e} for e in embeds * 2], GREEDY, use_tqdm=False)
        assert llm.llm_engine.last_stats.num_preemptions > 0, "the small KV cache should have preempted"
    finally:
        llm.shutdown()
    for output, reference in zip(outputs, references * 2):
        check_against_hf(output, reference)


def test_placeholder_ids_never_share_blocks_and_prefixes_of_embeddings_do(dirs):
    """The engine core sees placeholder ids (0) for embeddings: a token prompt of zeros must not
    read their blocks, nor they its; embeddings sharing their first 16 rows share 2 blocks; the same
    rows in another dtype share none."""
    hidden = hf_model(dirs["llama"]).config.hidden_size
    base = random_embeds(20, hidden, seed=1)
    other = torch.cat([base[:16], random_embeds(4, hidden, seed=2)])
    llm = engine(dirs["llama"], dtype="float32")
    try:
        zeros, = llm.generate({"prompt_token_ids": [0] * 20}, GREEDY, use_tqdm=False)
        first, = llm.generate({"prompt_embeds": base}, GREEDY, use_tqdm=False)
        again, = llm.generate({"prompt_token_ids": [0] * 20}, GREEDY, use_tqdm=False)
        shared, = llm.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)
        as_half, = llm.generate({"prompt_embeds": base.to(torch.float16)}, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 16  # its own earlier blocks, not the embeddings'
    assert again.outputs[0].token_ids == zeros.outputs[0].token_ids
    assert first.outputs[0].token_ids != zeros.outputs[0].token_ids
    assert shared.num_cached_tokens == 16
    assert as_half.num_cached_tokens == 0


def test_repetition_penalty_counts_generated_tokens_only_and_seeds_reproduce(dirs):
    model = hf_model(dirs["llama"])
    embeds = random_embeds(7, model.config.hidden_size, seed=9)
    tokens, _ = hf_greedy_from_embeds(model, embeds, max_tokens=12, repetition_penalty=3.0)
    llm = engine(dirs["llama"])
    try:
        penalised, = llm.generate({"prompt_embeds": embeds},
                                  SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                 repetition_penalty=3.0), use_tqdm=False)
        sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=2, ignore_eos=True)
        first, = llm.generate({"prompt_embeds": embeds}, sampled, use_tqdm=False)
        second, = llm.generate({"prompt_embeds": embeds}, sampled, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(penalised.outputs[0].token_ids) == tokens
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len(first.outputs) == 2


def test_refusals_name_the_field_and_the_engine_goes_on(dirs):
    hidden = hf_model(dirs["llama"]).config.hidden_size
    good = random_embeds(5, hidden, seed=3)
    llm = engine(dirs["llama"], max_model_len=32)
    try:
        cases = [
            ({"prompt_embeds": good[0]}, "prompt_embeds", "shape"),
            ({"prompt_embeds": torch.zeros(4, hidden + 1)}, "prompt_embeds", "hidden_size"),
            ({"prompt_embeds": torch.zeros(4, hidden, dtype=torch.int64)}, "prompt_embeds", "floating"),
            ({"prompt_embeds": torch.full((4, hidden), float("nan"))}, "prompt_embeds", "NaN"),
            ({"prompt_embeds": torch.zeros(0, hidden)}, "prompt_embeds", "empty"),
            ({"prompt_embeds": [[0.0] * hidden]}, "prompt_embeds", "torch.Tensor"),
            ({"prompt_embeds": good, "prompt_token_ids": [1, 2]}, "prompt_token_ids", "not both"),
            ({"prompt_embeds": torch.zeros(40, hidden)}, "prompt", "max_model_len"),
        ]
        for prompt, field, phrase in cases:
            with pytest.raises(InvalidArgumentError, match=phrase) as info:
                llm.generate(prompt, GREEDY, use_tqdm=False)
            assert info.value.field == field, prompt
        with pytest.raises(InvalidArgumentError, match="prompt_logprobs") as info:
            llm.generate({"prompt_embeds": good}, SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
        assert info.value.field == "prompt_logprobs"
        # A batch of three: one 3-D tensor of a batch of 1 (taken as 2-D) and a bfloat16 one.
        outputs = llm.generate([{"prompt_embeds": good}, {"prompt_embeds": good[None]},
                                {"prompt_embeds": good.to(torch.bfloat16)}], GREEDY, use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
        assert len(outputs[2].outputs[0].token_ids) == MAX_TOKENS
        # truncate_prompt_tokens keeps the last rows, as it keeps the last tokens.
        cut, = llm.generate({"prompt_embeds": torch.cat([random_embeds(3, hidden, 8), good])},
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                           truncate_prompt_tokens=5), use_tqdm=False)
        assert cut.outputs[0].token_ids == outputs[0].outputs[0].token_ids and cut.prompt_length == 5
    finally:
        llm.shutdown()


def test_without_the_flag_embeddings_are_refused_and_spec_decoding_does_not_combine(dirs):
    hidden = hf_model(dirs["llama"]).config.hidden_size
    llm = LLM(dirs["llama"], multiprocess=False, dtype="float32", max_model_len=64)
    try:
        with pytest.raises(InvalidArgumentError, match="enable_prompt_embeds") as info:
            llm.generate({"prompt_embeds": torch.zeros(3, hidden)}, GREEDY, use_tqdm=False)
        assert info.value.field == "prompt_embeds"
        assert llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    with pytest.raises(ConfigError, match="enable_prompt_embeds"):
        LLM(dirs["llama"], enable_prompt_embeds=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})


def test_async_scheduling_over_tensor_parallel_ranks_gives_the_same_tokens(dirs):
    hidden = hf_model(dirs["llama"]).config.hidden_size
    prompts = [{"prompt_embeds": random_embeds(n, hidden, seed=n)} for n in (4, 19)]
    results = []
    for overrides in ({}, {"async_scheduling": True, "tensor_parallel_size": 2, "multiprocess": True}):
        llm = engine(dirs["llama"], **overrides)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert results[0] == results[1]


def test_tensor_data_round_trips_every_dtype():
    from sparrow.utils.tensor_data import from_tensor_data, to_tensor_data

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensor = random_embeds(3, 5, seed=0).to(dtype)
        back = from_tensor_data(to_tensor_data(tensor))
        assert back.dtype == dtype and torch.equal(back, tensor)
    with pytest.raises(ValueError, match="float64"):
        to_tensor_data(torch.zeros(2, dtype=torch.float64))


# -- the server ---------------------------------------------------------------------------------
def encode(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    yield from serve_for_module(dirs["llama"], tmp_path_factory, "prompt-embeds-logs", "--enable-prompt-embeds",
                                "--dtype", "float32")


def test_completions_take_base64_embeddings_with_the_openai_client(server, dirs):
    model = hf_model(dirs["llama"])
    embeds = random_embeds(6, model.config.hidden_size, seed=5)
    tokens, _ = hf_greedy_from_embeds(model, embeds)
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(dirs["llama"]).decode(tokens)
    client = server.client()
    # The SDK needs a prompt: an empty one adds none (vLLM's usage).
    one = client.completions.create(model=MODEL_NAME, prompt="", max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"prompt_embeds": encode(embeds), "ignore_eos": True,
                                                "return_token_ids": True})
    assert one.choices[0].text == expected and one.choices[0].token_ids == tokens
    assert one.usage.prompt_tokens == 6 and one.usage.completion_tokens == MAX_TOKENS
    # Several embeddings and a text prompt: the embeddings' choices come first.
    several = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"prompt_embeds": [encode(embeds), encode(embeds[:3])],
                                                    "ignore_eos": True})
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.choices[0].text == expected
    text_only = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert several.choices[2].text == text_only.choices[0].text
    streamed = client.completions.create(model=MODEL_NAME, prompt="", max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, extra_body={"prompt_embeds": encode(embeds), "ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected


@pytest.mark.parametrize("body, param, phrase", [
    ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
    ({"prompt_embeds": base64.b64encode(b"plain bytes").decode()}, "prompt_embeds", "torch.save"),
    ({"prompt_embeds": [encode(torch.zeros(2, 64)), encode(torch.zeros(2, 3))]}, "prompt_embeds",
     "prompt_embeds[1]: prompt_embeds must have shape [num_tokens, 64]"),
    ({"prompt_embeds": encode({"a": torch.zeros(2)})}, "prompt_embeds", "dict"),
    ({"prompt_embeds": []}, "prompt_embeds", "empty"),
    ({"prompt_embeds": encode(torch.zeros(2, 64)), "echo": True}, "echo", "prompt_embeds"),
    ({"prompt_embeds": encode(torch.zeros(2, 64)), "prompt_logprobs": 1}, "prompt_logprobs", "prompt_embeds"),
    ({}, "prompt", "required"),
])
def test_completion_refusals_are_400s_naming_the_field(server, body, param, phrase):
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "max_tokens": 2, **body},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and phrase in error["message"], error
    assert server.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1).choices[0].text is not None
