"""vLLM's collective_rpc with a function and apply_model, as research code uses them: a lambda
(pickled across the engine core's process) runs on the worker and sees the model Sparrow loaded,
whose weights equal HF transformers' on the same directory; arguments, refusals and timeouts.
Tensor parallelism (two ranks, results in rank order) is checked in tests/test_tensor_parallel.py."""

from __future__ import annotations

import time

import pytest
import torch

from sparrow import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, dtype="float32", max_model_len=128, num_kv_blocks=32)  # the engine core in its own process
    yield engine
    engine.shutdown()


def test_apply_model_sees_the_weights_hf_loads_and_may_change_them(llm, qwen3_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True)
    [ours] = llm.apply_model(lambda model: model.model.embed_tokens.weight.detach().clone())
    torch.testing.assert_close(ours, hf.model.embed_tokens.weight.detach(), rtol=0, atol=0)
    [norms] = llm.apply_model(lambda model: {name: tuple(param.shape) for name, param in model.named_parameters()
                                             if name.endswith("input_layernorm.weight")})
    assert norms == {name: tuple(param.shape) for name, param in hf.named_parameters()
                     if name.endswith("input_layernorm.weight")}
    # A change made through apply_model is what the engine then runs: with the final norm's
    # weight zeroed every logit is 0, and greedy sampling picks the lowest token id.
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids != [0, 0, 0]

    def zero_final_norm(model):
        with torch.no_grad():
            model.model.norm.weight.zero_()
        return True

    assert llm.apply_model(zero_final_norm) == [True]
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == [0, 0, 0]


def test_a_function_gets_its_arguments_and_any_result_comes_back(llm):
    scale = 3  # captured: the function is pickled with its closure
    results = llm.collective_rpc(lambda worker, x, y=1: (type(worker).__name__, worker.rank, (x + y) * scale),
                                 args=(2,), kwargs={"y": 5})
    assert results == [("CpuWorker", 0, 21)]
    [tensor] = llm.collective_rpc(lambda worker: torch.arange(4))
    assert torch.equal(tensor, torch.arange(4))
    assert llm.collective_rpc("thread_settings")[0]["num_threads"] >= 1  # a method by name, as before


def test_bad_calls_are_value_errors_naming_the_argument_and_the_engine_carries_on(llm):
    for kwargs, field in [({"method": 3}, "method must be a worker method's name or a function"),
                          ({"method": "_private"}, "method must name a public worker method"),
                          ({"method": "thread_settings", "timeout": 0}, "timeout must be a positive number"),
                          ({"method": "thread_settings", "args": 5}, "args must be a tuple"),
                          ({"method": "thread_settings", "kwargs": {1: 2}}, "kwargs must be a dict with string keys")]:
        with pytest.raises(ValueError, match=field):
            llm.collective_rpc(**kwargs)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        llm.collective_rpc(lambda worker: 1 / 0)
    # The in-process executor runs the call to its end; one that took too long is a TimeoutError.
    with pytest.raises(TimeoutError, match="took longer than 0.1 s"):
        llm.collective_rpc(lambda worker: time.sleep(0.3), timeout=0.1)
    output = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 2


def test_a_worker_extension_adds_methods_called_by_name(qwen3_dir):
    """vLLM's worker_extension_cls, as RLHF code uses it: its methods run on the worker (``self``
    is the worker) and are called by name; one that would replace the worker's is refused."""
    from transformers import AutoModelForCausalLM

    from sparrow.config import ConfigError

    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True)
    expected = float(hf.model.embed_tokens.weight.detach().double().sum())
    with LLM(qwen3_dir, dtype="float32", max_model_len=128, num_kv_blocks=32,
             worker_extension_cls="tests.worker_extension.ProbeExtension") as llm:  # vLLM's dotted form
        assert llm.collective_rpc("embedding_sum") == [pytest.approx(expected, rel=1e-9)]
        assert llm.collective_rpc("scale_embeddings", args=(2.0,)) == [True]
        assert llm.collective_rpc("embedding_sum") == [pytest.approx(2 * expected, rel=1e-9)]
    for path, message in [("tests.worker_extension:ClashingExtension", "defines load_model, which the worker"),
                          ("tests.worker_extension:NoSuchClass", "cannot import"),
                          ("tests.worker_extension:torch", "is a module, not a class")]:
        with pytest.raises(ConfigError, match=f"worker_extension_cls.*{message}"):
            LLM(qwen3_dir, worker_extension_cls=path)
