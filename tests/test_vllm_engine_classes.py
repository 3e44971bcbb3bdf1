"""vLLM's engine classes and prompt types, as code written against vLLM uses them after changing
the import: EngineArgs / AsyncEngineArgs (vllm.engine.arg_utils), LLMEngine's add_request / step
loop, LLM(**vars(args)) on a parser with every engine flag, and TextPrompt / TokensPrompt.
The step-by-step example (examples/llm_engine.py) runs as a user runs it and is checked against
HF transformers on the same directory."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llm_engine.py"
MAX_TOKENS = 8


def test_the_names_import_from_where_vllm_code_imports_them():
    import sparrow
    from sparrow import (  # noqa: F401
        AsyncEngineArgs,
        AsyncLLM,
        AsyncLLMEngine,
        EngineArgs,
        LLMEngine,
        PromptType,
        TextPrompt,
        TokensPrompt,
    )
    from sparrow.engine import arg_utils
    from sparrow.inputs import TokensPrompt as Tokens

    assert AsyncLLMEngine is AsyncLLM and Tokens is TokensPrompt
    assert arg_utils.EngineArgs is EngineArgs and issubclass(AsyncEngineArgs, EngineArgs)
    assert {"EngineArgs", "LLMEngine", "TokensPrompt"} <= set(sparrow.__all__)
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}


def test_engine_args_check_names_at_once_and_vars_gives_the_set_ones():
    from sparrow import EngineArgs
    from sparrow.config import ConfigError

    args = EngineArgs(max_model_len=256)
    args.enforce_eager = True
    assert vars(args) == {"model": None, "max_model_len": 256, "enforce_eager": True}
    assert args.dtype == "auto"  # unset: the default
    assert repr(args) == "EngineArgs(model=None, max_model_len=256, enforce_eager=True)"
    with pytest.raises(ConfigError, match="unknown engine argument 'max_modle_len'"):
        EngineArgs(max_modle_len=256)
    with pytest.raises(ConfigError, match="unknown engine argument 'swap_spaces'"):
        args.swap_spaces = 4
    with pytest.raises(ConfigError, match="max_model_len"):
        EngineArgs(max_model_len="long").create_engine_config()


def test_a_parser_with_every_engine_flag_feeds_llm_and_engine_args(qwen3_dir):
    from sparrow import LLM, EngineArgs
    from sparrow.config import EngineConfig

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parser.add_argument("--max-tokens", type=int, default=4)  # the script's own flag, as in vLLM's examples
    args = parser.parse_args(["--model", qwen3_dir, "--max-model-len", "256", "--num-kv-blocks", "32",
                              "--scheduling-policy", "priority"])
    engine_args = EngineArgs.from_cli_args(args)
    assert vars(engine_args) == {"model": qwen3_dir, "max_model_len": 256, "num_kv_blocks": 32,
                                 "scheduling_policy": "priority", "seed": 0}
    kwargs = vars(args)
    kwargs.pop("max_tokens")
    # Every unset flag is None (seed: its default, since seed=None draws a random one), and the
    # configuration equals the one of the flags that were set.
    assert kwargs["dtype"] is None and kwargs["seed"] == 0
    expected = engine_args.create_engine_config().flat()
    assert EngineConfig.from_kwargs(**kwargs).flat() == expected
    assert expected["scheduler"] == "priority" and expected["seed"] == 0
    llm = LLM(**kwargs, multiprocess=False)
    try:
        assert llm.llm_engine.config.scheduler.scheduler == "priority"
        assert llm.llm_engine.config.model.max_model_len == 256
    finally:
        llm.shutdown()


def hf_greedy(model_dir: str, prompts: list, max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else tokenizer(prompt).input_ids
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            results.append(out[0, len(ids):].tolist())
    return results


def test_the_step_by_step_example_runs_as_a_user_runs_it_and_equals_hf(qwen3_dir):
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import llm_engine as example
    finally:
        sys.path.pop(0)
    result = subprocess.run([sys.executable, str(EXAMPLE), "--model", qwen3_dir, "--dtype", "float32",
                             "--max-model-len", "256", "--num-kv-blocks", "64", "--max-tokens", str(MAX_TOKENS),
                             "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    finished = json.loads(result.stdout.strip().splitlines()[-1])
    requests = example.requests(MAX_TOKENS)
    assert set(finished) == {request_id for request_id, _, _ in requests}
    greedy = [(request_id, prompt) for request_id, prompt, params in requests if params.temperature == 0]
    expected = hf_greedy(qwen3_dir, [prompt for _, prompt in greedy], MAX_TOKENS)
    assert [finished[request_id] for request_id, _ in greedy] == expected
    assert len(finished["sampled"]) == MAX_TOKENS


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    from sparrow import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir, dtype="float32", max_model_len=256,
                                                   num_kv_blocks=64), enable_multiprocessing=False)
    yield engine
    engine.shutdown()


def run_all(engine) -> dict[str, list[int]]:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    return finished


def test_add_request_takes_vllms_arguments_in_vllms_order(engine, qwen3_dir):
    from sparrow import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9])
    # vLLM's fourth positional argument is arrival_time, time.time() seconds as in vLLM.
    engine.add_request("positional", prompt, params, time.time())
    engine.add_request("keywords", prompt, params, arrival_time=None, lora_request=None, tokenization_kwargs=None,
                       trace_headers=None, priority=0)
    engine.add_request("defaults", prompt)  # params=None: the model's generation-config defaults
    finished, metrics = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
                metrics[output.request_id] = output.metrics
    # The wall-clock arrival is on the engine's clock: its latencies are those of the others.
    for name in ("positional", "keywords"):
        assert 0 <= metrics[name].first_token_time - metrics[name].arrival_time < 60
    assert engine.step() == []  # idle, after requests ran: at once, not blocked on the engine
    expected = hf_greedy(qwen3_dir, [prompt], MAX_TOKENS)[0]
    assert finished["positional"] == finished["keywords"] == expected
    assert finished["defaults"]  # ran to its default length
    assert engine.get_tokenizer() is engine.tokenizer


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"trace_headers": {"traceparent": "00-x"}}, "trace_headers"),
    ({"tokenization_kwargs": {"truncation": True}}, "tokenization_kwargs"),
    ({"priority": 1.5}, "priority"),
    ({"arrival_time": float("nan")}, "arrival_time"),
    ({"params": {"max_tokens": 2}}, "params"),
    ({"prompt": {"prompt": "hi", "multi_modal_data": {"image": 1}}}, "prompt.multi_modal_data"),
])
def test_add_request_refuses_what_it_cannot_honour_naming_the_field(engine, kwargs, field):
    from sparrow import SamplingParams

    call = {"prompt": "hi", "params": SamplingParams(max_tokens=2), **kwargs}
    with pytest.raises(ValueError) as info:
        engine.add_request("bad", **call)
    assert getattr(info.value, "field", None) == field, info.value
    assert not engine.has_unfinished_requests()


def test_from_engine_args_refuses_what_it_cannot_honour(qwen3_dir):
    from sparrow import EngineArgs, LLMEngine

    with pytest.raises(ValueError, match="stat_loggers"):
        LLMEngine.from_engine_args(EngineArgs(model=qwen3_dir), stat_loggers=[object()])
    with pytest.raises(TypeError, match="must be an EngineArgs"):
        LLMEngine.from_engine_args({"model": qwen3_dir})
