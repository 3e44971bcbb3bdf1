"""The engine checks: the whole engine (scheduler, worker, model, sampler) on the platform under
test, on tiny random-weight models of the built-in architectures.

- ``greedy_vs_hf[arch]``: greedy tokens equal Hugging Face transformers', for prompts of 1 to 75
  tokens in one batch under a 32-token step budget (chunked prefill), then again from the prefix
  cache. A difference passes only at a near-tie of HF's own logprobs (the prompt is then not
  compared further: the contexts differ from there on).
- ``seeded_sampling``: a seeded request draws the same tokens alone, in a batch with other
  (seeded, unseeded and greedy) requests, and when it joins a batch already decoding.
- ``preemption``: with a KV cache too small for the batch, requests are preempted and resumed,
  and every output equals that of an unpressured engine.
- ``kv_connector[shared_storage]``: a producer engine saves its prefills, a consumer loads them
  instead of computing them, and its outputs equal a plain engine's.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, field
from typing import Any

MAX_TOKENS = 6
GREEDY_PROMPT_LENGTHS = (1, 6, 17, 40, 75)
STEP_BUDGET = 32  # max_num_batched_tokens of the greedy check: the longer prompts are chunked
# A token that differs from HF's passes only when HF itself ranks the two within this margin (logprob).
NEAR_TIE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}
CONNECTOR = "shared_storage"


@dataclass(slots=True)
class EngineRun:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> output token ids
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # request id -> prefix-cache hits
    preemptions: int = 0  # since the engine started
    loaded_tokens: int = 0  # tokens a KV connector loaded, since the engine started


def drive(llm: Any, requests: list[tuple[str, list[int], Any]], join_after: dict[str, int] | None = None) -> EngineRun:
    """Step ``llm``'s engine until ``requests`` [(request id, prompt ids, SamplingParams)] finish.
    ``join_after``: request id -> engine steps to run before adding it (joining a running batch)."""
    engine = llm.llm_engine
    join_after = join_after or {}
    pending = [r for r in requests if join_after.get(r[0], 0) > 0]
    for request_id, prompt, params in requests:
        if join_after.get(request_id, 0) <= 0:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    run = EngineRun()
    steps = 0
    while engine.has_unfinished_requests() or pending:
        for request_id, prompt, params in [r for r in pending if join_after[r[0]] <= steps]:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            pending = [r for r in pending if r[0] != request_id]
        for output in engine.step():
            if output.finished:
                run.tokens[output.request_id] = list(output.outputs[0].token_ids)
                run.num_cached_tokens[output.request_id] = output.num_cached_tokens or 0
        steps += 1
        stats = engine.last_stats
        if stats is not None:
            # The engine's counters run from its start (every check builds a fresh engine).
            run.preemptions = max(run.preemptions, stats.num_preemptions)
            run.loaded_tokens = max(run.loaded_tokens, stats.kv_connector_loaded_tokens)
    return run


def random_prompts(lengths: tuple[int, ...] | list[int], seed: int, vocab_size: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab_size - 8) for _ in range(length)] for length in lengths]


def greedy(max_tokens: int = MAX_TOKENS) -> Any:
    from sparrow import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# -- greedy tokens against Hugging Face --------------------------------------------------------
def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[Any]]]:
    """Per prompt: HF's greedy tokens and, per step, the log-softmax of its logits."""
    import torch

    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(prompt):].tolist()
            results.append((tokens, [step[0].float().log_softmax(-1) for step in out.logits]))
    return results


def compare_with_hf(tokens: list[int], reference: tuple[list[int], list[Any]], near_tie: float) -> str | None:
    """Why ``tokens`` differ from HF's beyond a near-tie, or None."""
    hf_tokens, hf_logprobs = reference
    if len(tokens) != len(hf_tokens):
        return f"{len(tokens)} tokens, HF {len(hf_tokens)}"
    for step, (ours, theirs) in enumerate(zip(tokens, hf_tokens)):
        if ours == theirs:
            continue
        margin = float(hf_logprobs[step][theirs] - hf_logprobs[step][ours])
        if margin <= near_tie:
            return None  # a near-tie: either token is right, and the contexts differ from here on
        return f"token {step} is {ours}, HF {theirs} (HF logprob margin {margin:.2g})"
    return None


def greedy_vs_hf_check(ctx: Any, arch: str) -> tuple[str, str]:
    prompts = random_prompts(GREEDY_PROMPT_LENGTHS, seed=len(arch))
    reference = hf_greedy(ctx.hf_model(arch), prompts, MAX_TOKENS)
    requests = [(f"p{i}", prompt, greedy()) for i, prompt in enumerate(prompts)]
    llm = ctx.llm(arch, max_num_batched_tokens=STEP_BUDGET)
    try:
        prefix_caching = llm.llm_engine.config.cache.enable_prefix_caching
        first = drive(llm, requests)
        second = drive(llm, [(f"again-{rid}", prompt, params) for rid, prompt, params in requests])
    finally:
        llm.shutdown()
    near_tie = NEAR_TIE.get(ctx.engine_dtype, 5e-2)
    for label, run, prefix in (("first pass", first, ""), ("prefix-cached pass", second, "again-")):
        for index, prompt in enumerate(prompts):
            problem = compare_with_hf(run.tokens.get(f"{prefix}p{index}", []), reference[index], near_tie)
            if problem is not None:
                return "FAIL", f"{label}, prompt {index} ({len(prompt)} tokens): {problem}"
    cached = sum(second.num_cached_tokens.values())
    if prefix_caching and cached == 0:
        return "FAIL", "the second pass of the same prompts found nothing in the prefix cache"
    return "pass", (f"{len(prompts)} prompts of {min(GREEDY_PROMPT_LENGTHS)}-{max(GREEDY_PROMPT_LENGTHS)} tokens x "
                    f"{MAX_TOKENS} tokens, {STEP_BUDGET}-token steps, then {cached} prompt tokens from the prefix "
                    f"cache; {ctx.engine_dtype}")


# -- seeded sampling is independent of the batch -----------------------------------------------
def seeded_sampling_check(ctx: Any) -> tuple[str, str]:
    from sparrow import SamplingParams

    target = SamplingParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
    neighbours = [
        SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.7, top_p=0.8, ignore_eos=True),  # unseeded
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),  # greedy
    ]
    target_prompt, *other_prompts = random_prompts((12, 30, 7, 19), seed=99)
    others = [(f"other{i}", prompt, params) for i, (prompt, params) in enumerate(zip(other_prompts, neighbours))]
    # No prefix cache: each run computes the target's prompt the same way, batch aside.
    llm = ctx.llm("qwen3", enable_prefix_caching=False)
    try:
        alone = drive(llm, [("alone", target_prompt, target)]).tokens["alone"]
        batched = drive(llm, [others[0], ("batched", target_prompt, target), *others[1:]]).tokens["batched"]
        joined = drive(llm, [*others, ("joined", target_prompt, target)], join_after={"joined": 2}).tokens["joined"]
    finally:
        llm.shutdown()
    if batched != alone:
        return "FAIL", f"seed 1234 drew {batched} in a batch of 4, {alone} alone"
    if joined != alone:
        return "FAIL", f"seed 1234 drew {joined} joining a running batch, {alone} alone"
    return "pass", "the same 8 tokens alone, in a batch of 4, and joining a running batch"


# -- preemption and resumption -----------------------------------------------------------------
def preemption_check(ctx: Any) -> tuple[str, str]:
    llm = ctx.llm("qwen3")
    try:
        block_size = llm.llm_engine.engine_core.call_utility("get_kv_cache_info")["block_size"]
        # Prompts one token short of two blocks: every request needs a third block after its second
        # token, and 7 blocks cannot hold four of them (12 blocks), so the scheduler must preempt.
        prompts = random_prompts([2 * block_size - 1] * 4, seed=5)
        requests = [(f"r{i}", prompt, greedy(8)) for i, prompt in enumerate(prompts)]
        expected = drive(llm, requests)
    finally:
        llm.shutdown()
    num_blocks = 7
    llm = ctx.llm("qwen3", num_kv_blocks=num_blocks, max_model_len=num_blocks * block_size)
    try:
        pressured = drive(llm, requests)
    finally:
        llm.shutdown()
    if pressured.preemptions == 0:
        return "FAIL", f"no request was preempted with {num_blocks} KV blocks of {block_size} tokens"
    for request_id, tokens in expected.tokens.items():
        if pressured.tokens.get(request_id) != tokens:
            return "FAIL", (f"{request_id} generated {pressured.tokens.get(request_id)} under preemption, "
                            f"{tokens} without")
    plural = "" if pressured.preemptions == 1 else "s"
    return "pass", (f"{pressured.preemptions} preemption{plural} ({num_blocks} blocks of {block_size} tokens); "
                    f"outputs unchanged")


# -- the KV connector round trip ---------------------------------------------------------------
def kv_connector_check(ctx: Any) -> tuple[str, str]:
    if CONNECTOR not in ctx.registry().kv_connectors:
        return "skip", f"no {CONNECTOR!r} KV connector registered"
    prompts = random_prompts((40, 65, 17), seed=11)
    requests = [(f"r{i}", prompt, greedy()) for i, prompt in enumerate(prompts)]
    llm = ctx.llm("qwen3", enable_prefix_caching=False)
    try:
        expected = drive(llm, requests)
    finally:
        llm.shutdown()
    with tempfile.TemporaryDirectory(prefix="sparrow-kv-", dir=ctx.work_dir) as storage_path:
        storage = {"storage_path": storage_path}
        llm = ctx.llm("qwen3", kv_connector=CONNECTOR, kv_role="kv_producer", kv_connector_extra_config=storage)
        try:
            drive(llm, [(rid, prompt, greedy(1)) for rid, prompt, _ in requests])
        finally:
            llm.shutdown()
        llm = ctx.llm("qwen3", enable_prefix_caching=False, kv_connector=CONNECTOR, kv_role="kv_consumer",
                      kv_connector_extra_config=storage)
        try:
            consumed = drive(llm, requests)
        finally:
            llm.shutdown()
    if consumed.loaded_tokens == 0:
        return "FAIL", "the consumer loaded no token the producer saved"
    for request_id, tokens in expected.tokens.items():
        if consumed.tokens.get(request_id) != tokens:
            return "FAIL", (f"{request_id} generated {consumed.tokens.get(request_id)} from the loaded KV cache, "
                            f"{tokens} computing it")
    return "pass", f"producer saved, consumer loaded {consumed.loaded_tokens} prompt tokens; outputs unchanged"
