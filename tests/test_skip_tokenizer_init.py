"""vLLM's ``skip_tokenizer_init``: an engine over a model directory with no tokenizer files takes
token-id prompts and returns token ids (RLHF frameworks tokenize themselves). Tokens equal HF
transformers' greedy ones on the same weights; what needs a tokenizer is refused naming the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError
from sparrow.sampling_params import BeamSearchParams, StructuredOutputsParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def weights_only_dir(qwen3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (source := Path(qwen3_dir) / name).is_file():
            shutil.copy(source, out / name)
    return str(out)


def test_token_ids_in_token_ids_out_equal_hf(weights_only_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(weights_only_dir, dtype=torch.float32, local_files_only=True)
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                               pad_token_id=0)[0, len(PROMPT):].tolist()
    with pytest.raises(ConfigError, match="tokenizer"):  # without the flag, the missing tokenizer is named
        LLM(weights_only_dir, dtype="float32", max_model_len=64, num_kv_blocks=8)
    # num_gpu_blocks_override: vLLM's name for num_kv_blocks.
    llm = LLM(weights_only_dir, dtype="float32", max_model_len=64, num_gpu_blocks_override=8,
              skip_tokenizer_init=True)
    try:
        assert llm.get_tokenizer() is None
        assert llm.collective_rpc("determine_num_kv_blocks") == [8]
        [out] = llm.generate({"prompt_token_ids": PROMPT},
                             SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1),
                             use_tqdm=False)
        assert list(out.outputs[0].token_ids) == expected
        assert out.outputs[0].text == "" and out.prompt is None
        assert all(entry[token].decoded_token is None for entry, token in zip(out.outputs[0].logprobs, expected))
        for call, field in [(lambda: llm.generate("text", use_tqdm=False), "prompt"),
                            (lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False), "messages"),
                            (lambda: llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(stop=["x"]),
                                                  use_tqdm=False), "stop strings"),
                            (lambda: llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(bad_words=["x"]),
                                                  use_tqdm=False), "bad_words"),
                            (lambda: llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
                                structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False),
                             "structured_outputs")]:
            with pytest.raises(ValueError, match=field):
                call()
        [again] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=5, temperature=0.0,
                                                                            ignore_eos=True), use_tqdm=False)
        assert list(again.outputs[0].token_ids) == expected  # the refusals cost nothing
        # Beam search too (the server's use_beam_search): token ids out, no text.
        [searched] = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=3))
        assert len(searched.sequences) == 2 and all(beam.text == "" for beam in searched.sequences)
        assert all(len(beam.tokens) == len(PROMPT) + 3 for beam in searched.sequences)
    finally:
        llm.shutdown()
    with pytest.raises(ConfigError, match="reasoning_parser"):
        LLM(weights_only_dir, skip_tokenizer_init=True, reasoning_parser="qwen3")
