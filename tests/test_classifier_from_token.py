"""vLLM's conversion of a causal LM into a sequence classifier through ``classifier_from_token``
(LLM rerankers such as Qwen3-Reranker), set through ``hf_overrides``.

The reference is HF transformers' ``AutoModelForCausalLM`` on the same directory: its logits at
the last prompt position, of the named tokens. ``from_2_way_softmax`` (``is_original_qwen3_reranker``)
is one label whose sigmoid is the softmax of the two tokens' logits, i.e. ``sigmoid(l_true -
l_false)``; ``no_post_processing`` gives one label per token, its logit. Both an untied LM head and
one tied to the embedding table are read.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_test_model

QUERY, DOCUMENTS = "what is the capital of France", ["Paris is the capital of France", "a cat", "Once upon a time"]
PROMPTS = ["Hello, my name is", "The capital of France is " * 5, "a"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("from-token")
    return {"untied": build_test_model(root / "untied", arch="qwen3", preset="test", seed=5, tie_word_embeddings=False),
            "tied": build_test_model(root / "tied", arch="qwen3", preset="test", seed=6, tie_word_embeddings=True)}


def hf_last_logits(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def logits(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1]

    return logits, tokenizer


def overrides(tokens, **extra):
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens, **extra}


def test_a_qwen3_reranker_scores_as_the_softmax_of_its_two_tokens(dirs):
    from sparrow import LLM

    logits, tokenizer = hf_last_logits(dirs["untied"])
    false, true = tokenizer.convert_ids_to_tokens([40, 97])
    ids = tokenizer.convert_tokens_to_ids([false, true])
    llm = LLM(dirs["untied"], hf_overrides=overrides([false, true], is_original_qwen3_reranker=True),
              max_model_len=128, multiprocess=False)
    try:
        config = llm.llm_engine.config.model
        assert (config.runner, config.convert) == ("pooling", "classify")
        assert llm.llm_engine.input_processor.pooling.supported_tasks == ("classify", "score", "token_classify")
        scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        for document, score in zip(DOCUMENTS, scores):
            pair = logits(tokenizer(QUERY, text_pair=document).input_ids)
            assert score.outputs.score == pytest.approx(float(torch.softmax(pair[ids], dim=0)[1]), abs=1e-5)
        [classified] = llm.classify(PROMPTS[1:2], use_tqdm=False)
        last = logits(tokenizer(PROMPTS[1]).input_ids)
        assert classified.outputs.probs == pytest.approx([float(torch.sigmoid(last[ids[1]] - last[ids[0]]))],
                                                         abs=1e-5)
    finally:
        llm.shutdown()


def test_no_post_processing_gives_each_tokens_logit_from_a_tied_head(dirs):
    from sparrow import LLM, PoolingParams

    logits, tokenizer = hf_last_logits(dirs["tied"])
    tokens = tokenizer.convert_ids_to_tokens([11, 52, 300])
    ids = tokenizer.convert_tokens_to_ids(tokens)
    llm = LLM(dirs["tied"], hf_overrides=overrides(tokens, method="no_post_processing"), max_model_len=128,
              max_num_batched_tokens=16, multiprocess=False)
    try:
        raw = llm.classify(PROMPTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        for prompt, output in zip(PROMPTS, raw):
            expected = logits(tokenizer(prompt).input_ids)[ids]
            assert torch.allclose(torch.tensor(output.outputs.probs), expected, atol=1e-4), prompt
        [probs] = llm.classify(PROMPTS[:1], use_tqdm=False)
        expected = torch.softmax(logits(tokenizer(PROMPTS[0]).input_ids)[ids], dim=0)
        assert torch.allclose(torch.tensor(probs.outputs.probs), expected, atol=1e-5)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("extra", "phrase"), [
    (dict(method="softmax"), "method must be one of from_2_way_softmax, no_post_processing"),
    (dict(), "method is needed with classifier_from_token"),
    (dict(method="from_2_way_softmax", classifier_from_token=["a", "b", "c"]), "must be two tokens"),
    (dict(method="no_post_processing", classifier_from_token=[]), "non-empty list of token strings"),
    (dict(method="no_post_processing", classifier_from_token=["no-such-token-here"]),
     "not one token of the model's vocabulary"),
    (dict(method="no_post_processing", architectures=["Qwen3ForCausalLM"]), "also set hf_overrides architectures"),
])
def test_conversion_settings_are_refused_naming_hf_overrides(dirs, extra, phrase):
    from sparrow import LLM
    from sparrow.config import ConfigError

    settings = overrides(["a", "b"])
    settings.update(extra)
    with pytest.raises(ConfigError, match=r"invalid engine argument 'hf_overrides'") as caught:
        LLM(dirs["untied"], hf_overrides=settings, multiprocess=False)
    assert phrase in str(caught.value)
