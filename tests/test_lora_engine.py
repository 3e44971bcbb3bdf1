"""Multi-LoRA through the whole engine (LLM -> scheduler -> CPU worker) on the small test model.

Each adapter's greedy tokens and logprobs must match HF transformers on a copy of the base model
with that adapter merged into its weights (``W + scaling * B @ A``); a batch mixing the base model
and adapters gives every request the tokens it gets alone; with ``max_loras=2`` a third adapter
takes a slot from the least recently used one; and prefix caching never shares blocks between
adapters (or with the base model).
"""

from __future__ import annotations

import random

import pytest

from sparrow import LLM, LoRARequest, SamplingParams
from sparrow.errors import InvalidArgumentError
from sparrow.tiny.lora import build_lora_adapter, merge_lora_adapter

MAX_TOKENS = 8
ATOL = 1e-3
PROMPT_LENGTHS = (3, 21, 45)
ENGINE = dict(multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              max_model_len=256, num_kv_blocks=64, block_size=16)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    """Three adapters of different shapes: every projection at rank 8; q, v and down at rank 4
    with rsLoRA scaling (the other projections' slots stay zero); attention only."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "all": dict(rank=8, alpha=16, seed=1),
        "qv_down": dict(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=2, use_rslora=True),
        "attention": dict(rank=8, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=3),
    }
    return {name: LoRARequest(name, index + 1, str(build_lora_adapter(qwen3_dir, root / name, **spec)))
            for index, (name, spec) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def prompts(qwen3_dir) -> list[dict]:
    from sparrow.model_loader import get_hf_config

    vocab_size = get_hf_config(qwen3_dir).vocab_size
    rng = random.Random(16)
    return [{"prompt_token_ids": [rng.randrange(8, vocab_size - 8) for _ in range(n)]} for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, **ENGINE)
    yield engine
    engine.shutdown()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int):
    """Per prompt: HF's greedy tokens on raw logits and each step's log-softmax. A plain loop, not
    ``generate``: its min_new_tokens masks EOS, which the engine (ignore_eos) may pick."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True)
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            tokens, logprobs = list(prompt), []
            for _ in range(max_tokens):
                step = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
                logprobs.append(step)
                tokens.append(int(step.argmax()))
            results.append((tokens[len(prompt):], logprobs))
    return results


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def lora_stats(llm) -> dict[str, int]:
    return llm.collective_rpc("lora_stats")[0]


@pytest.mark.parametrize("adapter", [None, "all", "qv_down"])
def test_greedy_tokens_and_logprobs_match_hf_on_the_merged_model(llm, adapters, prompts, qwen3_dir, tmp_path,
                                                                  adapter):
    lora_request = adapters[adapter] if adapter else None
    model_dir = qwen3_dir
    if lora_request is not None:
        model_dir = str(merge_lora_adapter(qwen3_dir, lora_request.lora_path, tmp_path / "merged"))
    reference = hf_greedy(model_dir, [p["prompt_token_ids"] for p in prompts], MAX_TOKENS)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_request)
    for index, (output, (hf_tokens, hf_logprobs)) in enumerate(zip(outputs, reference)):
        assert output.lora_request == lora_request
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt {index} under {adapter} differs from HF"
        for step, token_id in enumerate(completion.token_ids):
            ours = completion.logprobs[step][token_id].logprob
            assert abs(ours - hf_logprobs[step][token_id].item()) < ATOL, (adapter, index, step)


def test_adapters_change_the_output(llm, adapters, prompts):
    # Guards the parity test against an adapter path that silently adds nothing.
    results = [token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=r))
               for r in (None, adapters["all"], adapters["qv_down"])]
    assert results[0] != results[1] and results[0] != results[2] and results[1] != results[2]


def test_a_mixed_batch_gives_each_request_its_solo_tokens(llm, adapters, prompts):
    choices = [None, adapters["all"], adapters["qv_down"]]
    solo = {r: token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=r)) for r in choices}
    # Every prompt under every choice, interleaved so that one step mixes all three.
    batch = [(prompt_index, r) for prompt_index in range(len(prompts)) for r in choices]
    outputs = llm.generate([prompts[i] for i, _ in batch], GREEDY, use_tqdm=False,
                           lora_request=[r for _, r in batch])
    for (prompt_index, r), output in zip(batch, outputs):
        assert output.lora_request == r
        assert list(output.outputs[0].token_ids) == solo[r][prompt_index], (prompt_index, r)


def test_a_third_adapter_swaps_into_the_least_recently_used_slot(llm, adapters, prompts):
    first, second, third = adapters["all"], adapters["qv_down"], adapters["attention"]
    solo = {}
    for r in (first, second, third):
        solo[r] = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=r))
    before = lora_stats(llm)
    # Three adapters, two slots: the scheduler runs at most two at once (the worker refuses a
    # step with more), and the third waits for a slot, then swaps in.
    batch = [first, second, third] * len(prompts)
    batch_prompts = [prompts[i // 3] for i in range(len(batch))]
    outputs = llm.generate(batch_prompts, GREEDY, use_tqdm=False, lora_request=batch)
    for index, (r, output) in enumerate(zip(batch, outputs)):
        assert list(output.outputs[0].token_ids) == solo[r][index // 3], (index, r.lora_name)
    after = lora_stats(llm)
    assert after["num_swaps"] > before["num_swaps"]
    # The adapters swapped out come back with the right weights.
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=first)) == solo[first]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=second)) == solo[second]


def test_prefix_cache_blocks_are_not_shared_between_adapters(llm, adapters, prompts):
    prompt = {"prompt_token_ids": prompts[2]["prompt_token_ids"] * 2}  # 90 tokens: 5 full blocks
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()

    def hits_of(lora_request) -> tuple[int, int]:
        before = llm.llm_engine.last_stats.prefix_cache_hits if llm.llm_engine.last_stats else 0
        output = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)[0]
        return llm.llm_engine.last_stats.prefix_cache_hits - before, output.num_cached_tokens

    assert hits_of(adapters["all"]) == (0, 0)
    assert hits_of(adapters["qv_down"]) == (0, 0)  # same tokens, another adapter: no hit
    assert hits_of(None) == (0, 0)  # nor for the base model
    hits, cached = hits_of(adapters["all"])  # the same adapter again: its own blocks are found
    assert hits >= 80 and cached >= 80


def test_add_list_and_remove_loras(llm, adapters):
    third = adapters["attention"]
    assert llm.add_lora(third) is True
    assert third.lora_int_id in llm.list_loras()
    assert llm.remove_lora(third.lora_int_id) is True
    assert third.lora_int_id not in llm.list_loras()
    assert llm.remove_lora(third.lora_int_id) is False


def test_an_adapter_above_max_lora_rank_fails_alone(llm, adapters, prompts, qwen3_dir, tmp_path):
    big = LoRARequest("big", 9, str(build_lora_adapter(qwen3_dir, tmp_path / "big", rank=16, seed=4)))
    with pytest.raises(InvalidArgumentError, match="max_lora_rank=8") as info:
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=big)
    assert info.value.field == "lora_request" and "'r'" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="max_lora_rank"):
        llm.add_lora(big)
    # The engine carries on, adapters and all.
    assert len(llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=adapters["all"])) == 1


def test_lora_request_list_of_the_wrong_length_names_the_field(llm, adapters, prompts):
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[adapters["all"]])
    with pytest.raises(ValueError, match=r"lora_request\[1\]"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=[None, "all"])


def test_the_engine_core_refuses_an_adapter_a_client_did_not_check(llm, adapters, prompts, qwen3_dir, tmp_path):
    """A request that skipped the frontend's check (another client) is refused by the engine core
    itself, naming lora_request, before any worker sees it; the other requests carry on."""
    from sparrow.engine.messages import EngineCoreRequest

    big = LoRARequest("big", 9, str(build_lora_adapter(qwen3_dir, tmp_path / "big", rank=16, seed=4)))
    engine = llm.llm_engine
    _, good = engine.process_request("good", prompts[0], GREEDY, lora_request=adapters["all"])
    bad = EngineCoreRequest(request_id="bad", prompt_token_ids=good.prompt_token_ids,
                            sampling_params=good.sampling_params, eos_token_id=good.eos_token_id, max_tokens=4,
                            lora_request=big)
    engine.add_processed_request(None, good)
    with pytest.raises(InvalidArgumentError, match="max_lora_rank") as info:
        engine.engine_core.add_request(bad)  # in-process here; a multiprocess core answers an error output
    assert info.value.field == "lora_request"
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == ["good"] and len(finished["good"].outputs[0].token_ids) == MAX_TOKENS


def test_chat_takes_a_lora_request(llm, adapters):
    messages = [{"role": "user", "content": "Name a bird."}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base, adapted = (llm.chat(messages, params, use_tqdm=False, lora_request=r)[0] for r in (None, adapters["all"]))
    assert base.lora_request is None and adapted.lora_request == adapters["all"]
    assert base.outputs[0].token_ids != adapted.outputs[0].token_ids
