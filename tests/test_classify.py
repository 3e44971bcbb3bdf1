"""Sequence classifiers and cross-encoders: ``LLM.classify``, cross-encoder ``LLM.score``,
``AsyncLLM.encode(PoolingParams(task="classify"))``.

The reference is HF transformers' ``AutoModelForSequenceClassification`` on the same directory:
its logits (the ``score`` layer over the last token's final hidden state) through vLLM's
activation (softmax over several labels, sigmoid for one). The directories are saved locally by
transformers from a Qwen3 test model, a ``score`` layer drawn with a fixed seed and scaled so the
probabilities are far from uniform: ``Qwen3ForSequenceClassification`` with three labels, and a
one-label cross-encoder.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.conftest import build_test_model

PROMPTS = ["Hello, my name is", "The capital of France is " * 9, "a", "Once upon a time, in a land far away"]
QUERY, DOCUMENTS = "what is the capital of France", ["Paris is the capital of France", "a cat", "Once upon a time"]


def save_classifier(causal, out_dir, num_labels, seed, tokens=False):
    """A sequence classifier (``tokens``: a token classifier, whose score layer has a bias) saved by
    transformers from ``causal``, its score layer drawn with ``seed``."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    torch.manual_seed(seed)
    auto = AutoModelForTokenClassification if tokens else AutoModelForSequenceClassification
    model = auto.from_pretrained(causal, num_labels=num_labels, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.score.parameters():
            parameter.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(causal).save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    causal = build_test_model(root / "causal", arch="qwen3", preset="test", seed=11, tie_word_embeddings=False)
    return {"causal": causal, "classifier": save_classifier(causal, root / "classifier", 3, seed=1),
            "cross": save_classifier(causal, root / "cross", 1, seed=2)}


def hf_logits(model_dir):
    """prompt (text or token ids) -> HF's logits [num_labels] for it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def logits(prompt):
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0]

    return logits, tokenizer


def hf_token_logits(model_dir):
    """token ids -> HF's score layer over every final hidden state [tokens, num_labels]."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits(ids):
        with torch.no_grad():
            return model.score(model.model(torch.tensor([ids])).last_hidden_state)[0]

    return logits


def assert_close(got, expected, atol=1e-4):
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.allclose(got, expected, atol=atol), (got - expected).abs().max()


def test_classify_equals_hf_in_chunks_from_the_prefix_cache_and_without_activation(dirs):
    from sparrow import LLM, PoolingParams

    logits, _ = hf_logits(dirs["classifier"])
    # Recognized by its architecture alone; a 32-token budget splits the long prompt into chunks.
    llm = LLM(dirs["classifier"], max_model_len=256, max_num_batched_tokens=32, multiprocess=False)
    try:
        assert llm.llm_engine.config.model.runner == "pooling" and llm.llm_engine.config.model.convert == "classify"
        for _ in range(2):  # the second pass reads the prompts' prefixes from the cache
            outputs = llm.classify(PROMPTS, use_tqdm=False)
            for prompt, output in zip(PROMPTS, outputs):
                assert output.outputs.num_classes == 3 and output.finished
                assert_close(output.outputs.probs, torch.softmax(logits(prompt), dim=-1))
        assert outputs[1].num_cached_tokens >= 32
        raw = llm.classify(PROMPTS[:2], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        for prompt, output in zip(PROMPTS, raw):
            assert_close(output.outputs.probs, logits(prompt))
        # encode() is the same task, as a tensor; truncation keeps the prompt's last tokens.
        [encoded] = llm.encode([{"prompt_token_ids": list(range(5, 40))}], truncate_prompt_tokens=8, use_tqdm=False)
        assert encoded.prompt_token_ids == list(range(32, 40))
        assert_close(encoded.outputs.data, torch.softmax(logits(list(range(32, 40))), dim=-1))

        # vLLM's token_classify (LLM.reward): the score layer at every token, beside a classify request
        # of the same prompt in the same steps; it reads nothing from the prefix cache.
        token_logits = hf_token_logits(dirs["classifier"])
        rewarded, classified = llm.encode(PROMPTS[1:2] * 2, [PoolingParams(task="token_classify"), None],
                                          use_tqdm=False)
        assert_close(rewarded.outputs.data, torch.softmax(token_logits(rewarded.prompt_token_ids), dim=-1))
        assert rewarded.num_cached_tokens == 0 and classified.num_cached_tokens >= 32
        assert_close(classified.outputs.data, torch.softmax(logits(PROMPTS[1]), dim=-1))
        [reward] = llm.reward(PROMPTS[:1], use_tqdm=False)
        assert_close(reward.outputs.data, torch.softmax(token_logits(reward.prompt_token_ids), dim=-1))

        # Embedding requests and fields, and a score, which needs one label, are refused naming the field.
        for call, field in ((lambda: llm.embed(PROMPTS[:1]), "task"),
                            (lambda: llm.classify(PROMPTS[:1], pooling_params=PoolingParams(normalize=True)),
                             "normalize"),
                            (lambda: llm.classify(PROMPTS[:1], pooling_params=PoolingParams(dimensions=2)),
                             "dimensions"),
                            (lambda: llm.score(QUERY, DOCUMENTS), "task"),
                            (lambda: llm.encode(PROMPTS[:1], pooling_task="token_embed"), "task"),
                            (lambda: llm.generate(PROMPTS[:1]), "sampling_params")):
            with pytest.raises(ValueError) as excinfo:
                call()
            assert excinfo.value.field == field, excinfo.value
        # The engine is unharmed by the refusals.
        assert_close(llm.classify(PROMPTS[2:3], use_tqdm=False)[0].outputs.probs,
                     torch.softmax(logits(PROMPTS[2]), dim=-1))
    finally:
        llm.shutdown()


def test_cross_encoder_scores_each_pair_read_together_as_hf(dirs):
    from sparrow import LLM

    logits, tokenizer = hf_logits(dirs["cross"])
    llm = LLM(dirs["cross"], max_model_len=128, multiprocess=False)
    try:
        def expected(first, second):
            return float(torch.sigmoid(logits(tokenizer(first, text_pair=second).input_ids))[0])

        one_to_many = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        assert [o.outputs.score for o in one_to_many] == pytest.approx([expected(QUERY, d) for d in DOCUMENTS],
                                                                       abs=1e-5)
        assert one_to_many[0].prompt_token_ids == tokenizer(QUERY, text_pair=DOCUMENTS[0]).input_ids
        side_by_side = llm.score(DOCUMENTS[:2], [QUERY, QUERY], use_tqdm=False)
        assert [o.outputs.score for o in side_by_side] == pytest.approx(
            [expected(d, QUERY) for d in DOCUMENTS[:2]], abs=1e-5)
        # classify() on a one-label model: the sigmoid of its logit.
        [single] = llm.classify(PROMPTS[:1], use_tqdm=False)
        assert_close(single.outputs.probs, torch.sigmoid(logits(PROMPTS[0])))
        with pytest.raises(ValueError) as excinfo:
            llm.score({"prompt_token_ids": [1, 2]}, DOCUMENTS)
        assert excinfo.value.field == "data_1"
    finally:
        llm.shutdown()


def test_problem_type_and_pooler_config_choose_the_activation(dirs):
    from sparrow import LLM

    logits, _ = hf_logits(dirs["classifier"])
    # transformers' regression: the outputs are the logits; multi-label: one sigmoid each.
    for problem_type, activation in (("regression", lambda x: x), ("multi_label_classification", torch.sigmoid)):
        llm = LLM(dirs["classifier"], max_model_len=64, hf_overrides={"problem_type": problem_type},
                  multiprocess=False)
        try:
            assert_close(llm.classify(PROMPTS[:1], use_tqdm=False)[0].outputs.probs, activation(logits(PROMPTS[0])))
        finally:
            llm.shutdown()
    llm = LLM(dirs["classifier"], max_model_len=64, pooler_config={"use_activation": False}, multiprocess=False)
    try:
        assert_close(llm.classify(PROMPTS[:1], use_tqdm=False)[0].outputs.probs, logits(PROMPTS[0]))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs, field", [
    (dict(model="causal", convert="classify"), "convert"),
    (dict(model="causal", task="score"), "task"),
    (dict(model="classifier", runner="generate"), "runner"),
    (dict(model="classifier", task="embed", convert="classify"), "task"),
    (dict(model="classifier", pooler_config={"normalize": True}), "pooler_config.normalize"),
    (dict(model="causal", runner="pooling", pooler_config={"use_activation": True}), "pooler_config.use_activation"),
    (dict(model="classifier", task="reward"), "task"),
])
def test_classifier_settings_that_cannot_run_are_refused_naming_the_field(dirs, kwargs, field):
    from sparrow import LLM
    from sparrow.config import ConfigError

    kwargs = dict(kwargs)
    model = dirs[kwargs.pop("model")]
    with pytest.raises((ConfigError, ValueError), match=f"'{field}'|{field}"):
        LLM(model, max_model_len=64, multiprocess=False, **kwargs)


def test_a_classifier_embeds_when_asked_and_async_classifies_concurrently(dirs):
    """convert="embed" on a classifier checkpoint pools its hidden states (the score layer is
    left unread); AsyncLLM.encode with task="classify" serves concurrent requests."""
    from transformers import AutoModel

    from sparrow import LLM, PoolingParams
    from sparrow.engine.arg_utils import AsyncEngineArgs
    from sparrow.engine.async_llm import AsyncLLM

    encoder = AutoModel.from_pretrained(dirs["classifier"], dtype=torch.float32).eval()
    _, tokenizer = hf_logits(dirs["classifier"])
    llm = LLM(dirs["classifier"], convert="embed", max_model_len=64, multiprocess=False)
    try:
        ids = tokenizer(PROMPTS[0]).input_ids
        with torch.no_grad():
            hidden = encoder(torch.tensor([ids])).last_hidden_state[0, -1]
        assert_close(llm.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding,
                     torch.nn.functional.normalize(hidden, dim=0))
    finally:
        llm.shutdown()

    logits, _ = hf_logits(dirs["classifier"])

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=dirs["classifier"], max_model_len=128))
        try:
            assert await engine.get_supported_tasks() == ("classify", "token_classify")

            async def one(index):
                params = PoolingParams(task="classify")
                async for output in engine.encode(PROMPTS[index], params, f"r{index}"):
                    last = output
                return index, last

            return await asyncio.gather(*(one(index) for index in range(len(PROMPTS))))
        finally:
            engine.shutdown()

    for index, output in asyncio.run(run()):
        assert_close(output.outputs.data, torch.softmax(logits(PROMPTS[index]), dim=-1))


def test_classifier_and_encoder_architectures_run_on_their_causal_lm_classes():
    """The registry's names for what transformers saves: X*ForSequenceClassification and XModel run
    on XForCausalLM; Gemma 3's text-only classes (Gemma3Text*) on Gemma3ForCausalLM."""
    from types import SimpleNamespace

    from sparrow.models.registry import BUILTIN_ARCHITECTURES, resolve_model_class

    registry = dict(BUILTIN_ARCHITECTURES)
    for saved, runs_on in (("Qwen3ForSequenceClassification", "Qwen3ForCausalLM"), ("LlamaModel", "LlamaForCausalLM"),
                           ("Gemma3TextForSequenceClassification", "Gemma3ForCausalLM"),
                           ("Gemma3TextModel", "Gemma3ForCausalLM"), ("MixtralForSequenceClassification",
                                                                      "MixtralForCausalLM")):
        expected = registry[runs_on].rpartition(":")[2]
        assert resolve_model_class(SimpleNamespace(architectures=[saved]), registry).__name__ == expected, saved
