"""Token-level pooling: vLLM's ``token_embed`` and ``token_classify`` tasks, a token classifier
(``*ForTokenClassification``), ``LLM.reward``, and ``encode(pooling_task="encode")``.

The reference is HF transformers on the same directories: ``AutoModelForTokenClassification``'s
logits at every token (its ``score`` layer, with a bias, over each final hidden state) through
vLLM's activation (softmax over several labels), and ``AutoModel``'s final hidden states for
``token_embed`` (each row L2-normalized unless ``normalize=False``). A 32-token budget splits
the long prompt into chunks, and token-level requests share steps with prompt-vector ones; a
token-level request never reads the prefix cache (every position's output is needed), while the
vector requests beside it still do.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_test_model
from tests.test_classify import save_classifier

LONG = "The capital of France is " * 9
PROMPTS = ["Hello, my name is", LONG, "a", "Once upon a time, in a land far away"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("token-pooling")
    causal = build_test_model(root / "causal", arch="qwen3", preset="test", seed=11, tie_word_embeddings=False)
    return {"causal": causal, "token": save_classifier(causal, root / "token", 4, seed=3, tokens=True)}


def hf_rows(model_dir, token_classifier):
    """prompt (text or token ids) -> HF's [tokens, width] rows: a token classifier's logits, or
    the final hidden states."""
    from transformers import AutoModel, AutoModelForTokenClassification, AutoTokenizer

    auto = AutoModelForTokenClassification if token_classifier else AutoModel
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def rows(prompt):
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        return (out.logits if token_classifier else out.last_hidden_state)[0]

    return rows, tokenizer


def assert_close(got, expected, atol=1e-4):
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.allclose(got, expected, atol=atol), (got - expected).abs().max()


def test_token_classifier_rewards_every_token_as_hf(dirs):
    from sparrow import LLM, PoolingParams

    logits, tokenizer = hf_rows(dirs["token"], token_classifier=True)
    llm = LLM(dirs["token"], max_model_len=256, max_num_batched_tokens=32, multiprocess=False)
    try:
        config = llm.llm_engine.config.model
        assert (config.runner, config.convert) == ("pooling", "classify")
        assert llm.llm_engine.input_processor.pooling.supported_tasks == ("token_classify",)
        for _ in range(2):  # the second pass finds the prompts cached, and must not read them
            outputs = llm.reward(PROMPTS, use_tqdm=False)
            for prompt, output in zip(PROMPTS, outputs):
                assert output.prompt_token_ids == tokenizer(prompt).input_ids and output.finished
                assert_close(output.outputs.data, torch.softmax(logits(prompt), dim=-1))
            assert outputs[1].num_cached_tokens == 0
        # encode(): the same by default and as vLLM's "encode"; raw logits without the activation;
        # truncation keeps the prompt's last tokens.
        for task in (None, "encode", "token_classify"):
            [encoded] = llm.encode(PROMPTS[:1], pooling_task=task, use_tqdm=False)
            assert_close(encoded.outputs.data, torch.softmax(logits(PROMPTS[0]), dim=-1))
        [raw] = llm.reward(PROMPTS[3:], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        assert_close(raw.outputs.data, logits(PROMPTS[3]))
        [cut] = llm.reward([{"prompt_token_ids": list(range(5, 40))}], truncate_prompt_tokens=8, use_tqdm=False)
        assert cut.prompt_token_ids == list(range(32, 40))
        assert_close(cut.outputs.data, torch.softmax(logits(list(range(32, 40))), dim=-1))
        # A token classifier has no per-prompt task; embedding fields do not apply.
        for call, field in ((lambda: llm.classify(PROMPTS[:1]), "task"), (lambda: llm.embed(PROMPTS[:1]), "task"),
                            (lambda: llm.score("a", ["b"]), "task"),
                            (lambda: llm.reward(PROMPTS[:1], pooling_params=PoolingParams(normalize=True)),
                             "normalize")):
            with pytest.raises(ValueError) as excinfo:
                call()
            assert excinfo.value.field == field, excinfo.value
        assert_close(llm.reward(PROMPTS[2:3], use_tqdm=False)[0].outputs.data,
                     torch.softmax(logits(PROMPTS[2]), dim=-1))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_token_embed_shares_steps_with_prompt_vectors(dirs, pooling_type):
    from sparrow import LLM, PoolingParams

    hidden, _ = hf_rows(dirs["causal"], token_classifier=False)
    caching = pooling_type == "LAST"  # MEAN pooling reads every position too: no prefix caching
    llm = LLM(dirs["causal"], runner="pooling", pooler_config={"pooling_type": pooling_type}, max_model_len=256,
              max_num_batched_tokens=32, enable_prefix_caching=caching, multiprocess=False)
    try:
        assert llm.llm_engine.input_processor.pooling.supported_tasks == ("embed", "token_embed")
        if pooling_type == "LAST":  # the progress bar of a pooling run shows the prompts' speed only
            import io

            from tqdm import tqdm

            bars = []

            class Recorded(tqdm):
                def __init__(self, *args, **kwargs):
                    super().__init__(*args, file=io.StringIO(), **kwargs)
                    bars.append(self)

            llm.encode(PROMPTS[:2], use_tqdm=Recorded)
            assert bars[0].n == 2 and "est. speed input: " in bars[0].postfix and "output" not in bars[0].postfix
        prompts = [LONG, LONG, PROMPTS[0], PROMPTS[3]]
        params = [PoolingParams(task="token_embed"), PoolingParams(task="embed"), PoolingParams(task="embed"),
                  PoolingParams(task="token_embed", normalize=False)]
        for _ in range(2):
            outputs = llm.encode(prompts, params, use_tqdm=False)
            rows = [hidden(prompt) for prompt in prompts]
            assert_close(outputs[0].outputs.data, torch.nn.functional.normalize(rows[0], dim=-1))
            for index in (1, 2):
                pooled = rows[index][-1] if pooling_type == "LAST" else rows[index].mean(dim=0)
                assert_close(outputs[index].outputs.data, torch.nn.functional.normalize(pooled, dim=0))
            assert_close(outputs[3].outputs.data, rows[3])
        assert outputs[0].num_cached_tokens == 0
        assert (outputs[1].num_cached_tokens > 0) == caching
        # LLM.embed() refuses a token-level output; encode's "encode" is token_embed here.
        [encoded] = llm.encode(PROMPTS[:1], pooling_task="encode", use_tqdm=False)
        assert_close(encoded.outputs.data, torch.nn.functional.normalize(hidden(PROMPTS[0]), dim=-1))
        with pytest.raises(ValueError) as excinfo:
            llm.encode(PROMPTS[:1], pooling_task="token_classify")
        assert excinfo.value.field == "task"
    finally:
        llm.shutdown()
