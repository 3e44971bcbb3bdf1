"""The offline API end to end: seeds, n, stop strings, chat, validation, the CLI."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from sparrow import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=512, num_kv_blocks=256)
    yield engine
    engine.shutdown()


def random_prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(rng.randrange(5, 120))]} for _ in range(n)]


def test_seeded_request_is_the_same_alone_in_a_batch_and_under_preemption(qwen3_dir, llm):
    target = random_prompts(1, seed=5)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(12, seed=6)
    noisy = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate(others[:6] + [target] + others[6:], [noisy] * 6 + [seeded] + [noisy] * 6, use_tqdm=False)
    assert batch[6].outputs[0].token_ids == alone
    # 12 blocks of 16 tokens: the batch cannot fit at once, so requests are preempted and recomputed.
    # Prompts of 60 tokens take 4 blocks each; three are admitted into 12 blocks and the first to
    # grow a fifth block forces a preemption.
    rng = random.Random(12)
    target, *others = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(60)]} for _ in range(6)]
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    small = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=256, num_kv_blocks=12)
    engine = small.llm_engine
    outputs, num_preemptions = {}, 0
    try:
        for index, (prompt, params) in enumerate(zip([target] + others[:5], [seeded] + [noisy] * 5)):
            engine.add_request(str(index), prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
            num_preemptions += engine.last_stats.num_preemptions
    finally:
        small.shutdown()
    assert num_preemptions > 0
    assert outputs["0"] == alone


def test_different_seeds_differ_and_n_gives_distinct_samples(llm):
    prompt = random_prompts(1, seed=8)[0]
    a = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True), use_tqdm=False)
    b = llm.generate(prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_stop_string_split_across_tokens_ends_the_request(llm):
    prompt = random_prompts(1, seed=9)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]  # characters that straddle token boundaries more often than not
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_length(llm):
    prompt = random_prompts(1, seed=10)[0]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert free.outputs[0].finish_reason == "length"
    stop_id = free.outputs[0].token_ids[4]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    first = free.outputs[0].token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.outputs[0].token_ids[: first + 1]


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "Hello sparrow"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected
    assert out.prompt_token_ids == llm.get_tokenizer()(expected, add_special_tokens=False)["input_ids"]


def test_bad_prompts_are_rejected_before_any_work_starts(llm):
    good = random_prompts(2, seed=11)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([good[0], ""], params, use_tqdm=False)
    with pytest.raises(ValueError, match="outside"):
        llm.generate([good[0], {"prompt_token_ids": [1, 999999]}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len|max_tokens"):
        llm.generate({"prompt_token_ids": [5] * 600}, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(good, params, use_tqdm=False)) == 2


def test_chat_takes_vllms_template_arguments(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=3, temperature=0.0)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi the"}]
    out = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert out.prompt.endswith("Hi the")
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ flavour }}]{% endfor %}"
    out = llm.chat(messages[:1], params, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"flavour": "salty"})[0]
    assert out.prompt == "[user|Hello|salty]"
    with pytest.raises(ValueError, match="continue_final_message cannot be combined"):
        llm.chat(messages, params, use_tqdm=False, continue_final_message=True)
    with pytest.raises(TypeError, match="add_generation_prompt must be a bool"):
        llm.chat(messages, params, use_tqdm=False, add_generation_prompt="no")


def test_wrong_prompt_and_message_types_name_what_is_wrong(llm):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    for prompts in (5, None, b"bytes"):
        with pytest.raises(TypeError, match="prompts must be a string, a prompt dict or a list of them"):
            llm.generate(prompts, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\].content must be a string, a list of content parts"):
        llm.chat([{"role": "user", "content": 5}], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\] has no 'content'"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "assistant"}], params, use_tqdm=False)
    # Token ids as a numpy array or a tensor are the same prompt as a list.
    import numpy as np
    import torch

    ids = [5, 17, 300, 42]
    want = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    for array in (np.array(ids), torch.tensor(ids)):
        assert llm.generate({"prompt_token_ids": array}, params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_arguments_are_strict_about_types(qwen3_dir):
    import pathlib

    import numpy as np

    from sparrow.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="'enforce_eager': Input should be a valid boolean .*got 'yes'"):
        EngineConfig.from_kwargs(enforce_eager="yes")
    with pytest.raises(ConfigError, match="'max_model_len': Input should be a valid integer .*got True"):
        EngineConfig.from_kwargs(max_model_len=True)
    with pytest.raises(ConfigError, match="'gpu_memory_utilization'"):
        EngineConfig.from_kwargs(gpu_memory_utilization="0.5")
    # What a Python caller reasonably passes is taken: a path, numpy numbers, an int for a float.
    config = EngineConfig.from_kwargs(model=pathlib.Path(qwen3_dir), max_model_len=np.int64(64),
                                      gpu_memory_utilization=1)
    assert (config.model.model, config.model.max_model_len) == (qwen3_dir, 64)
    assert config.cache.gpu_memory_utilization == 1.0
    # seed=None (vLLM's): one random seed, drawn once.
    seeds = {EngineConfig.from_kwargs(seed=None).model.seed for _ in range(3)}
    assert len(seeds) > 1 and all(isinstance(seed, int) and seed >= 0 for seed in seeds)
    for settings in ({"kv_role": "kv_producer"}, {"kv_connector_extra_config": {"storage_path": "/kv"}}):
        name = next(iter(settings))
        with pytest.raises(ConfigError, match=f"{name} is set but kv_connector is not"):
            EngineConfig.from_kwargs(**settings)


def test_sampling_params_errors_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_unknown_engine_argument_lists_valid_ones():
    from sparrow.config import ConfigError

    with pytest.raises(ConfigError, match="unknown engine argument 'max_seqs'.*max_num_seqs"):
        LLM(max_seqs=3)
    # A vLLM argument Sparrow does not take says why.
    with pytest.raises(ConfigError, match="'swap_space' \\(vLLM's\\) is not taken: Sparrow preempts by recomputation"):
        LLM(swap_space=4)
    with pytest.raises(ConfigError, match="block_size"):
        LLM(block_size=-4)


def test_cli_generate_prints_the_continuation(qwen3_dir):
    env = dict(os.environ, SPARROW_ENABLE_MULTIPROCESSING="0")
    result = subprocess.run(
        [sys.executable, "-m", "sparrow.entrypoints.cli", "generate", qwen3_dir, "--prompt", "Hello",
         "--max-tokens", "5", "--max-model-len", "128", "--num-kv-blocks", "64"],
        capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello")
    assert len(result.stdout.strip()) > len("Hello")


def test_truncate_prompt_tokens_keeps_the_last_tokens(qwen3_dir, llm):
    # vLLM's SamplingParams.truncate_prompt_tokens: the reference is HF greedy on the kept tokens.
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    prompt = random_prompts(1, seed=9)[0]["prompt_token_ids"]
    assert len(prompt) > 12
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(truncate_prompt_tokens=12, temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-12:]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt[-12:]]), max_new_tokens=5, do_sample=False)[0, 12:].tolist()
    assert list(out.outputs[0].token_ids) == expected
    max_model_len = llm.llm_engine.config.model.max_model_len
    too_long = (prompt * (max_model_len // len(prompt) + 2))[:max_model_len + 5]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=1), use_tqdm=False)
    kept = llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0]
    assert kept.prompt_token_ids == too_long[-(max_model_len - 1):]
    for value in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens") as info:
            SamplingParams(truncate_prompt_tokens=value)
        assert info.value.field == "truncate_prompt_tokens"
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or between 1 and max_model_len"):
        llm.generate("hello", SamplingParams(truncate_prompt_tokens=max_model_len + 1), use_tqdm=False)


def test_pooling_entry_points_are_refused_by_name(llm):
    # A generative engine has no pooler.
    for method, call in (("encode", lambda: llm.encode(["hello"])), ("embed", lambda: llm.embed(["hello"])),
                         ("classify", lambda: llm.classify(["hello"])), ("score", lambda: llm.score("hello", ["hi"])),
                         ("reward", lambda: llm.reward(["hello"]))):
        with pytest.raises(ValueError, match=rf"LLM.{method}\(\) needs a pooling model: start the LLM with "
                                             "runner='pooling'") as info:
            call()
        assert info.value.field == "runner"
    assert llm.generate("hello", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids


def test_use_tqdm_may_be_the_progress_bar_class(llm):
    """vLLM's use_tqdm takes a tqdm class (or factory) as well as a bool: the bar is built with it."""
    import io

    from tqdm import tqdm

    bars = []

    class Recorded(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, file=io.StringIO(), **kwargs)  # enabled, written nowhere
            bars.append(self)

    outputs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2), use_tqdm=Recorded)
    assert len(outputs) == 3 and len(bars) == 1
    assert bars[0].total == 3 and bars[0].n == 3
    assert "est. speed input: " in bars[0].postfix and ", output: " in bars[0].postfix


def test_what_vllm_callers_pass_is_taken_or_refused_by_name(llm):
    """An exploratory audit's findings: each once silently wrong or a confusing error."""
    import numpy as np
    import torch

    from sparrow.config import EngineConfig
    from sparrow.sampling_params import RequestOutputKind

    # A SamplingParams shared with streaming code (DELTA) still gives whole outputs offline, as vLLM's LLM.
    whole = llm.generate(["The sky is"], SamplingParams(max_tokens=6, ignore_eos=True, n=2, seed=3),
                         use_tqdm=False)[0]
    delta = llm.generate(["The sky is"], SamplingParams(max_tokens=6, ignore_eos=True, n=2, seed=3,
                                                        output_kind=RequestOutputKind.DELTA), use_tqdm=False)[0]
    assert [(c.text, list(c.token_ids)) for c in delta.outputs] == [(c.text, list(c.token_ids)) for c in whole.outputs]
    assert all(len(c.token_ids) == 6 for c in delta.outputs)
    # Wrong container types name the argument.
    for bad in ({"max_tokens": 3}, "greedy", 3):
        with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list") as info:
            llm.generate(["hi"], bad, use_tqdm=False)
        assert info.value.field == "sampling_params"
    with pytest.raises(ValueError, match="priority must be a list of ints") as info:
        llm.generate(["hi"], SamplingParams(max_tokens=1), priority=1, use_tqdm=False)
    assert info.value.field == "priority"
    assert len(llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=np.array([0, 0]), use_tqdm=False)) == 2
    # Image parts are refused whatever the content format (the built-in template loops over parts).
    with pytest.raises(ValueError, match="only text parts") as info:
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    assert info.value.field == "messages[0].content[1]"
    # logprobs=-1 is the whole vocabulary (vLLM's), checked against max_logprobs like any count.
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary, \d+\) exceeds the maximum"):
        llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="-1 for the whole vocabulary"):
        SamplingParams(logprobs=-2)
    # A torch.dtype is a dtype.
    assert EngineConfig.from_kwargs(dtype=torch.bfloat16).model.dtype == "bfloat16"
