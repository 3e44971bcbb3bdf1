"""YaRN RoPE scaling (Qwen's long-context setting) and the engine argument hf_overrides.

The reference is HF transformers on the same weights: a directory whose config.json carries a
YaRN ``rope_parameters`` (rope_theta 50000, factor 4 over an original context of 64 tokens, so the
prompts below run far past it) must give HF's greedy tokens and logprobs; and a copy without it,
given the same settings through ``hf_overrides``, must give the same again (``rope_scaling`` is
merged into the file's ``rope_parameters``, keeping its rope_theta)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sparrow import LLM, SamplingParams

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
THETA = 50000.0
MAX_POSITION = 256
PROMPT_LENS = (150, 40)
NEW_TOKENS = 8


def edit_config(directory: Path, **fields) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_scaling", None)
    config.update(fields)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    from sparrow.tiny.model import build_model_dir

    root = tmp_path_factory.mktemp("yarn")
    yarn = Path(build_model_dir(root / "yarn", "qwen3", "test", seed=13))
    base = root / "base"
    shutil.copytree(yarn, base)
    edit_config(yarn, max_position_embeddings=MAX_POSITION, rope_parameters={"rope_theta": THETA, **YARN})
    edit_config(base, max_position_embeddings=128, rope_parameters={"rope_theta": THETA, "rope_type": "default"})
    return {"yarn": str(yarn), "base": str(base)}


@pytest.fixture(scope="module")
def reference(dirs):
    """HF's greedy continuation and per-token logprobs of each prompt, on the YaRN directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs["yarn"], dtype=torch.float32).eval()
    assert model.config.rope_parameters["rope_type"] == "yarn"
    generator = torch.Generator().manual_seed(0)
    results = []
    for length in PROMPT_LENS:
        prompt = torch.randint(10, 4000, (length,), generator=generator).tolist()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0, length:].tolist()
        logprobs = [float(torch.log_softmax(score[0].float(), -1)[token]) for score, token in zip(out.scores, tokens)]
        results.append((prompt, tokens, logprobs))
    return results


def check_against(llm: LLM, reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt, _, _ in reference], params, use_tqdm=False)
    for output, (_, tokens, logprobs) in zip(outputs, reference):
        completion = output.outputs[0]
        assert list(completion.token_ids) == tokens
        got = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-3)


def engine(model_dir: str, **kwargs) -> LLM:
    # A small chunk budget: the long prompt is prefilled in several chunks, as in serving.
    return LLM(model=model_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64, **kwargs)


def test_yarn_equals_hf(dirs, reference):
    with engine(dirs["yarn"]) as llm:
        assert llm.llm_engine.config.model.max_model_len == MAX_POSITION
        check_against(llm, reference)


def test_hf_overrides_give_the_same_model_as_the_edited_config(dirs, reference):
    overrides = {"max_position_embeddings": MAX_POSITION, "rope_scaling": YARN}
    with engine(dirs["base"], hf_overrides=overrides) as llm:
        # max_model_len follows the overridden max_position_embeddings
        assert llm.llm_engine.config.model.max_model_len == MAX_POSITION
        check_against(llm, reference)
    # Without the overrides the base directory is a different model (plain RoPE, 128 positions).
    with engine(dirs["base"]) as llm:
        assert llm.llm_engine.config.model.max_model_len == 128
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        prompt, tokens, _ = reference[1]  # 40 tokens: fits the base model's 128 positions
        assert list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids) \
            != tokens


def test_hf_overrides_merge_and_validation(dirs):
    from sparrow.config import ConfigError, EngineConfig
    from sparrow.model_loader import get_hf_config

    config = get_hf_config(dirs["base"], overrides={"rope_scaling": YARN, "my_new_field": 3})
    assert config.rope_parameters == {"rope_theta": THETA, **YARN} and config.my_new_field == 3
    with pytest.raises(ConfigError, match="hf_overrides"):
        EngineConfig.from_kwargs(hf_overrides=["rope_scaling"])
    with pytest.raises(Exception, match="rope_scaling type 'dynamic'.*not supported"):
        engine(dirs["base"], hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_the_engine_cores_token_id_guard_reads_the_overridden_config(dirs):
    """The engine core range-checks token ids against the vocabulary of the config the model is
    built from, hf_overrides included (it used to read config.json on its own)."""
    from sparrow.config import EngineConfig
    from sparrow.engine.request_guard import model_vocab_size
    from sparrow.model_loader import get_hf_config

    own = get_hf_config(dirs["base"]).vocab_size
    assert model_vocab_size(EngineConfig.from_kwargs(model=dirs["base"]).model) == own
    section = EngineConfig.from_kwargs(model=dirs["base"], hf_overrides={"vocab_size": own - 5}).model
    assert model_vocab_size(section) == own - 5
