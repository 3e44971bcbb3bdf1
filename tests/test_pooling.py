"""Pooling (embedding) models: ``runner="pooling"``, ``LLM.embed`` / ``encode``, ``AsyncLLM.encode``.

The reference is HF transformers' ``AutoModel`` on the same directory: its ``last_hidden_state``
pooled as the engine is configured (the last token, the mean, or the first), L2-normalized
where the pooler normalizes. Directories are built locally: a Qwen3 test model, and the encoder
``AutoModel`` saves from it (architecture ``Qwen3Model``, tensors without the ``model.`` prefix,
no LM head), which is how embedding checkpoints are laid out.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import pytest
import torch

from tests.conftest import build_test_model

PROMPTS = ["Hello, my name is", "The capital of France is " * 9, "a", "Once upon a time, in a land far away"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from transformers import AutoModel, AutoTokenizer

    root = tmp_path_factory.mktemp("pooling")
    causal = build_test_model(root / "causal", arch="qwen3", preset="test", seed=7, tie_word_embeddings=False)
    encoder = root / "encoder"
    AutoModel.from_pretrained(causal, dtype=torch.float32).save_pretrained(encoder)
    AutoTokenizer.from_pretrained(causal).save_pretrained(encoder)
    # A sentence-transformers layout of the same encoder: mean pooling, then Normalize.
    st = root / "st-mean"
    shutil.copytree(encoder, st)
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False}))
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    return {"causal": causal, "encoder": str(encoder), "st": str(st)}


@pytest.fixture(scope="module")
def hf_reference(dirs):
    """prompt (text or token ids) -> final hidden states [len, hidden] of HF's AutoModel."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(dirs["encoder"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(dirs["encoder"])

    def hidden(prompt):
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]

    return hidden


def pooled(hidden, kind, normalize):
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_close(got, expected, atol=1e-4):
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=atol), (got - expected).abs().max()


def test_embed_equals_hf_last_token_in_chunks_and_from_the_prefix_cache(dirs, hf_reference):
    from sparrow import LLM

    # A 32-token budget splits the long prompt into chunks; prefix caching is on (LAST pooling).
    llm = LLM(dirs["encoder"], max_model_len=256, max_num_batched_tokens=32, multiprocess=False)
    try:
        assert llm.llm_engine.config.model.runner == "pooling"  # auto: Qwen3Model is an encoder
        assert llm.llm_engine.config.cache.enable_prefix_caching
        for attempt in range(2):
            outputs = llm.embed(PROMPTS, use_tqdm=False)
            assert [o.prompt for o in outputs] == PROMPTS
            for prompt, output in zip(PROMPTS, outputs):
                assert output.finished and output.outputs.hidden_size == 64
                assert_close(output.outputs.embedding, pooled(hf_reference(prompt), "LAST", True))
        # The second pass found the long prompt's full blocks in the cache, recomputed its last token.
        assert outputs[1].num_cached_tokens >= 32
        # encode(): the same vector as a tensor; normalize=False gives the raw hidden state.
        from sparrow import PoolingParams

        raw = llm.encode({"prompt_token_ids": [5, 6, 7, 8]}, PoolingParams(normalize=False), use_tqdm=False)[0]
        assert isinstance(raw.outputs.data, torch.Tensor) and raw.outputs.data.dtype == torch.float32
        assert_close(raw.outputs.data, pooled(hf_reference([5, 6, 7, 8]), "LAST", False))
        # A prompt may fill max_model_len (nothing is generated after it); one more token is refused.
        longest = [(7 * i) % 4000 for i in range(256)]
        full = llm.embed({"prompt_token_ids": longest}, use_tqdm=False)[0]
        assert_close(full.outputs.embedding, pooled(hf_reference(longest), "LAST", True))
        with pytest.raises(ValueError, match="257 tokens long, which is longer than max_model_len=256"):
            llm.embed({"prompt_token_ids": longest + [1]}, use_tqdm=False)
        assert llm.embed({"prompt_token_ids": longest + [1]}, truncate_prompt_tokens=-1,
                         use_tqdm=False)[0].prompt_token_ids == longest[1:] + [1]
        # truncate_prompt_tokens keeps the prompt's last k tokens.
        ids = list(range(10, 40))
        cut = llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=8, use_tqdm=False)[0]
        assert cut.prompt_token_ids == ids[-8:]
        assert_close(cut.outputs.embedding, pooled(hf_reference(ids[-8:]), "LAST", True))
        # score(): the cosine similarity of two texts' vectors, one against many or side by side.
        def hf_cosine(a, b):
            return float(torch.nn.functional.cosine_similarity(hf_reference(a)[-1], hf_reference(b)[-1], dim=0))

        one_to_many = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
        assert [round(o.outputs.score, 4) for o in one_to_many] == [round(hf_cosine(PROMPTS[0], p), 4)
                                                                    for p in PROMPTS[1:]]
        side_by_side = llm.score(PROMPTS[:2], PROMPTS[2:], use_tqdm=False)
        assert [o.outputs.score for o in side_by_side] == pytest.approx(
            [hf_cosine(PROMPTS[0], PROMPTS[2]), hf_cosine(PROMPTS[1], PROMPTS[3])], abs=1e-4)
        assert side_by_side[0].prompt_token_ids == outputs[0].prompt_token_ids + outputs[2].prompt_token_ids
        with pytest.raises(ValueError, match="same length") as excinfo:
            llm.score(PROMPTS[:2], PROMPTS[:3])
        assert excinfo.value.field == "data_1"
        # A generation request on a pooling engine is refused, naming the field.
        with pytest.raises(ValueError, match="pooling") as excinfo:
            llm.generate("Hello")
        assert excinfo.value.field == "sampling_params"
    finally:
        llm.shutdown()


def test_sentence_transformers_mean_pooling_in_chunks_and_through_preemption(dirs, hf_reference):
    from sparrow import LLM, PoolingParams

    rng = random.Random(5)
    prompts = [[rng.randrange(4000) for _ in range(length)] for length in (90, 75, 60, 41, 3)]
    # 8 blocks of 16 tokens (one is the null block) for five prompts of up to 90 tokens, each
    # computed 16 tokens a step beside the others: the cache fills before they finish, requests
    # are preempted and computed again, and their carried sums start over.
    llm = LLM(dirs["st"], max_model_len=128, max_num_batched_tokens=64, long_prefill_token_threshold=16,
              num_kv_blocks=8, block_size=16, multiprocess=False)
    try:
        config = llm.llm_engine.config
        assert config.model.pooler_config == {"pooling_type": "MEAN", "normalize": True}  # from the ST files
        assert not config.cache.enable_prefix_caching  # MEAN reads every token: caching is off by default
        outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert_close(output.outputs.data, pooled(hf_reference(prompt), "MEAN", True))
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.num_preemptions > 0
        # Token-level requests among them (vLLM's token_embed): their kept rows start over too.
        before = scheduler.num_preemptions
        params = [PoolingParams(task="token_embed") if index % 2 == 0 else None for index in range(len(prompts))]
        outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for index, (prompt, output) in enumerate(zip(prompts, outputs)):
            expected = torch.nn.functional.normalize(hf_reference(prompt), dim=-1) if index % 2 == 0 else \
                pooled(hf_reference(prompt), "MEAN", True)
            assert_close(output.outputs.data, expected)
        assert scheduler.num_preemptions > before
    finally:
        llm.shutdown()


def test_cls_pooling_over_the_files_and_the_causal_lm_checkpoint_with_an_adapter(dirs, hf_reference,
                                                                                  tmp_path_factory):
    from sparrow import LLM

    llm = LLM(dirs["st"], max_model_len=128, max_num_batched_tokens=16,
              pooler_config={"pooling_type": "cls", "normalize": False}, multiprocess=False)
    try:
        assert llm.llm_engine.config.model.pooler_config == {"pooling_type": "CLS", "normalize": False}
        for prompt, output in zip(PROMPTS, llm.encode(PROMPTS, use_tqdm=False)):
            assert_close(output.outputs.data, pooled(hf_reference(prompt), "CLS", False))
    finally:
        llm.shutdown()
    # The causal LM itself as an embedding model (vLLM's convert="embed"): its LM head is not read.
    # With a LoRA adapter, a request embeds as HF does on the weights with the adapter merged.
    from transformers import AutoModel

    from sparrow import LoRARequest
    from sparrow.tiny.lora import build_lora_adapter, merge_lora_adapter

    root = tmp_path_factory.mktemp("pooling-lora")
    adapter = build_lora_adapter(dirs["causal"], root / "adapter", rank=4, alpha=8, seed=2)
    merged = AutoModel.from_pretrained(merge_lora_adapter(dirs["causal"], adapter, root / "merged"),
                                       dtype=torch.float32).eval()
    llm = LLM(dirs["causal"], convert="embed", max_model_len=128, multiprocess=False, enable_lora=True,
              max_lora_rank=4)
    try:
        assert llm.llm_engine.config.model.runner == "pooling"
        for prompt, output in zip(PROMPTS, llm.embed(PROMPTS, use_tqdm=False)):
            assert_close(output.outputs.embedding, pooled(hf_reference(prompt), "LAST", True))
        lora = LoRARequest("adapter", 1, str(adapter))
        base_and_adapted = llm.embed([PROMPTS[3], PROMPTS[3]], lora_request=[None, lora], use_tqdm=False)
        assert_close(base_and_adapted[0].outputs.embedding, pooled(hf_reference(PROMPTS[3]), "LAST", True))
        with torch.no_grad():
            ids = torch.tensor([base_and_adapted[1].prompt_token_ids])
            expected = pooled(merged(ids).last_hidden_state[0], "LAST", True)
        assert_close(base_and_adapted[1].outputs.embedding, expected)
        base, adapted = (torch.tensor(output.outputs.embedding) for output in base_and_adapted)
        assert not torch.allclose(base, adapted, atol=1e-3)  # the adapter changed the vector
    finally:
        llm.shutdown()


def test_matryoshka_dimensions_and_the_engine_and_async_interfaces(dirs, hf_reference):
    from sparrow import AsyncLLM, LLMEngine, PoolingParams
    from sparrow.engine.arg_utils import EngineArgs

    args = EngineArgs(model=dirs["encoder"], max_model_len=128, hf_overrides={"matryoshka_dimensions": [16, 32]})
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
    try:
        engine.add_request("a", PROMPTS[0], PoolingParams(dimensions=16))
        engine.add_request("b", PROMPTS[3], None)  # None: a pooling engine's defaults
        with pytest.raises(ValueError, match="Matryoshka dimensions") as excinfo:
            engine.add_request("c", PROMPTS[0], PoolingParams(dimensions=20))
        assert excinfo.value.field == "dimensions"
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step()})
        # The first 16 values, normalized after the cut (vLLM's order).
        expected = torch.nn.functional.normalize(hf_reference(PROMPTS[0])[-1][:16], dim=0)
        assert_close(outputs["a"].outputs.data, expected)
        assert_close(outputs["b"].outputs.data, pooled(hf_reference(PROMPTS[3]), "LAST", True))
    finally:
        engine.shutdown()

    async def run():
        llm = AsyncLLM.from_engine_args(model=dirs["encoder"], max_model_len=128)
        try:
            assert await llm.get_supported_tasks() == ("embed", "token_embed")
            async def one(index, prompt):
                return [o async for o in llm.encode(prompt, PoolingParams(), f"r{index}")]

            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            with pytest.raises(ValueError, match="runner='pooling'"):
                async for _ in llm.generate("Hello", None, "g"):
                    pass
            return results
        finally:
            llm.shutdown()

    for prompt, outputs in zip(PROMPTS, asyncio.run(run())):
        assert len(outputs) == 1 and outputs[0].finished
        assert_close(outputs[0].outputs.data, pooled(hf_reference(prompt), "LAST", True))


@pytest.mark.parametrize("kwargs, field", [
    (dict(runner="generate"), "runner"),  # an encoder has no LM head
    (dict(pooler_config={"pooling_type": "ALL"}), "pooler_config"),
    (dict(pooler_config={"softmax": True}), "pooler_config"),
    (dict(runner="pooling", task="generate"), "runner"),
    (dict(pooler_config={"pooling_type": "MEAN"}, enable_prefix_caching=True), "enable_prefix_caching"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(async_scheduling=True), "async_scheduling"),
    (dict(runner="embedding"), "runner"),
    (dict(device="sim"), "runner"),  # the simulated device has no hidden states to pool
])
def test_configurations_a_pooling_model_cannot_run_are_refused_naming_the_field(dirs, kwargs, field):
    from sparrow import LLM
    from sparrow.config import ConfigError

    with pytest.raises(ConfigError, match=field):
        LLM(dirs["encoder"], max_model_len=128, **kwargs)


def test_pooling_requests_are_checked_before_the_engine_sees_them(dirs):
    from sparrow import PoolingParams
    from sparrow.engine.input_processor import InputProcessor

    for kwargs, field in ((dict(dimensions=0), "dimensions"), (dict(normalize="yes"), "normalize"),
                          (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(task="reward"), "task"),
                          (dict(use_activation="yes"), "use_activation")):
        with pytest.raises(ValueError) as excinfo:
            PoolingParams(**kwargs)
        assert excinfo.value.field == field
    # A generative engine's input processor (no pooling) refuses a pooling request, naming it.
    processor = InputProcessor(None, max_model_len=64, vocab_size=100)
    from sparrow.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="runner='pooling'") as excinfo:
        processor.process_inputs("x", {"prompt_token_ids": [1, 2]}, SamplingParams(), pooling_params=PoolingParams())
    assert excinfo.value.field == "pooling_params"


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_cuda_embeddings_equal_hf_with_graphs_and_chunks(dirs, hf_reference, kind):
    """On the GPU (skipped without one): the CUDA runner's graphs and padded steps pool the same
    vectors, in float32, through chunked prefill."""
    from sparrow import LLM

    llm = LLM(dirs["encoder"], device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=32,
              gpu_memory_utilization=0.3, pooler_config={"pooling_type": kind}, multiprocess=False)
    try:
        for prompt, output in zip(PROMPTS, llm.encode(PROMPTS, use_tqdm=False)):
            assert_close(output.outputs.data, pooled(hf_reference(prompt), kind, True), atol=1e-3)
    finally:
        llm.shutdown()
