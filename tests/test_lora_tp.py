"""Multi-LoRA with tensor parallelism: tensor_parallel_size=2 must give tensor_parallel_size=1's
greedy tokens and logprobs (within 1e-3, float32) for a batch mixing the base model and two
adapters in every step (tests/test_lora_engine.py checks tp=1 against HF transformers on the merged
model).

Each rank holds its slice of every adapter, cut as the base weights are: A whole and B's own output
rows for the column-parallel qkv_proj and gate_up_proj, A's own input columns and B whole for the
row-parallel o_proj and down_proj, whose shrink is all-reduced across the ranks. Two models: Qwen3
(two KV heads, one per rank) and Llama with one KV head (each rank holds a replica of it, and of
its rows of the adapters' k/v B). Real spawned workers and gloo, as in tests/test_tensor_parallel.py.

The row-parallel hook is also checked on its own, two ranks as two threads summing through a
barrier: with the torch reference op, and (in a subprocess under TRITON_INTERPRET=1) with the CUDA
platform's Triton op in bfloat16, the path a GPU takes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest
import torch

from sparrow import LLM, LoRARequest, SamplingParams
from sparrow.tiny.lora import build_lora_adapter

MAX_TOKENS = 8
ATOL = 1e-3
PROMPT_LENGTHS = (3, 21, 70)  # 70: longer than one step's budget, so prefill is chunked
ENGINE = dict(multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              max_model_len=256, num_kv_blocks=64, block_size=16, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
# Requests asking for logprobs do not speculate (sparrow.spec_decode.proposer.may_speculate).
TOKENS_ONLY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_models(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    from tests.conftest import build_test_model

    kv1 = build_test_model(tmp_path_factory.mktemp("kv1") / "llama_kv1", arch="llama", preset="test", seed=4,
                           num_key_value_heads=1)
    return {"qwen3": qwen3_dir, "llama_kv1": kv1}


def adapters_for(model_dir: str, root) -> list[LoRARequest]:
    """Every projection at rank 8; k, o and gate at rank 4 with rsLoRA (a smaller rank, zero-padded)."""
    specs = [dict(rank=8, alpha=16, seed=11),
             dict(rank=4, alpha=8, targets=("k_proj", "o_proj", "gate_proj"), seed=12, use_rslora=True)]
    return [LoRARequest(f"tp{index}", index + 1, str(build_lora_adapter(model_dir, root / f"tp{index}", **spec)))
            for index, spec in enumerate(specs)]


def mixed_batch(model_dir: str, adapters: list[LoRARequest]):
    """Every prompt under the base model and each adapter, interleaved so one step mixes all three."""
    from sparrow.model_loader import get_hf_config

    vocab_size = get_hf_config(model_dir).vocab_size
    rng = random.Random(17)
    # Random phrases repeated: prompt lookup finds them (speculation), the prefill is still ragged.
    phrases = [[rng.randrange(8, vocab_size - 8) for _ in range(5)] for _ in PROMPT_LENGTHS]
    prompts = [{"prompt_token_ids": (phrase * n)[:n]} for phrase, n in zip(phrases, PROMPT_LENGTHS)]
    choices = [None, *adapters]
    batch = [(prompt, choice) for prompt in prompts for choice in choices]
    return [p for p, _ in batch], [c for _, c in batch]


def run(model_dir: str, prompts, lora_requests, params: SamplingParams, **kwargs):
    llm = LLM(model_dir, **ENGINE, **kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
        if kwargs.get("speculative_config"):
            assert llm.llm_engine.last_stats.spec_decode_num_accepted_tokens > 0, "no draft accepted"
    finally:
        llm.shutdown()
    results = []
    for output in outputs:
        completion = output.outputs[0]
        results.append((list(completion.token_ids),
                        [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs or [])]))
    return results


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# The second case also speculates on the tp=2 side (n-gram): LoRA, tensor parallelism and
# speculative decoding together, at no extra engine start (tokens only: logprobs turn speculation off).
@pytest.mark.parametrize("model, speculative_config", [("qwen3", None), ("llama_kv1", NGRAM)])
def test_tp2_with_two_adapters_and_base_in_one_batch_equals_tp1(tp_models, tmp_path, model, speculative_config):
    model_dir = tp_models[model]
    adapters = adapters_for(model_dir, tmp_path)
    prompts, lora_requests = mixed_batch(model_dir, adapters)
    params = GREEDY if speculative_config is None else TOKENS_ONLY
    reference = run(model_dir, prompts, lora_requests, params)
    got = run(model_dir, prompts, lora_requests, params, tensor_parallel_size=2, speculative_config=speculative_config)
    for index, ((ref_tokens, ref_logprobs), (tokens, logprobs), r) in enumerate(zip(reference, got, lora_requests)):
        label = (index, r.lora_name if r else "base")
        assert tokens == ref_tokens, f"{label}: tp=2 tokens differ from tp=1"
        assert logprobs == pytest.approx(ref_logprobs, abs=ATOL), f"{label}: tp=2 logprobs differ from tp=1"
    # Guards the comparison against adapters that add nothing: every adapter changes some output.
    base = [tokens for (tokens, _), r in zip(got, lora_requests) if r is None]
    for adapter in adapters:
        adapted = [tokens for (tokens, _), r in zip(got, lora_requests) if r == adapter]
        assert adapted != base, f"{adapter.lora_name} changed nothing"


# -- the row-parallel hook alone ----------------------------------------------------------------------
class ThreadGroup:
    """Two "ranks" as threads: ``all_reduce`` sums their tensors in place, as a communicator does."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.parts: list = [None] * world_size

    def rank(self, rank: int):
        group = self

        class Rank:
            world_size = group.world_size

            def all_reduce(self, tensor):
                group.parts[rank] = tensor.clone()
                group.barrier.wait()
                total = sum(group.parts)
                group.barrier.wait()
                return tensor.copy_(total)
        Rank.rank = rank
        return Rank()


def check_row_parallel_hook(op_path: str, dtype_name: str) -> None:
    """Both ranks' hooked outputs equal the unsharded ``add_lora`` on the whole input."""
    from sparrow.lora.layers import LoRALayer, StepLoRAState, _RowParallelHook
    from sparrow.lora.ops import add_lora
    from sparrow.plugins import import_object

    kernel, lock = import_object(op_path), threading.Lock()

    def op(*args):  # one kernel call at a time: Triton's interpreter is not thread-safe
        with lock:
            return kernel(*args)

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(5)
    tokens, num_slots, rank, d_in, d_out, world = 11, 3, 8, 48, 40, 2
    x = torch.randn(tokens, d_in, generator=gen).to(dtype)
    y = torch.randn(tokens, d_out, generator=gen).to(dtype)  # the layer's reduced output, whole on every rank
    lora_a = (torch.randn(num_slots, rank, d_in, generator=gen) * 0.3).to(dtype)
    lora_b = (torch.randn(num_slots, d_out, rank, generator=gen) * 0.3).to(dtype)
    lora_a[1, 4:] = 0  # a rank-4 adapter, zero-padded
    lora_b[1, :, 4:] = 0
    token_slots = torch.tensor([0, -1, 1, 1, 0, 2, -1, 0, 2, 1, -1])
    scalings = torch.tensor([2.0, 0.5, 1.0])
    expected = add_lora(y.clone(), x, lora_a, lora_b, token_slots, scalings)
    group, shard = ThreadGroup(world), d_in // world
    results: list = [None] * world

    def run_rank(r: int) -> None:
        layer = LoRALayer(layer_index=0, name="o_proj", projections=("o_proj",), out_sizes=(d_out,), in_size=shard,
                          lora_a=lora_a[:, :, r * shard:(r + 1) * shard].contiguous(), lora_b=lora_b,
                          in_start=r * shard, tp=group.rank(r))
        state = StepLoRAState(scalings)
        state.active, state.token_slots = True, token_slots
        results[r] = _RowParallelHook(layer, state, op)(None, (x[:, r * shard:(r + 1) * shard],), y.clone())

    threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(result is not None for result in results), "a rank failed (its error is printed above)"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for result in results:
        torch.testing.assert_close(result.float(), expected.float(), atol=tol, rtol=tol)
    base = token_slots < 0
    assert torch.equal(results[0][base], y[base])  # base tokens untouched


def test_row_parallel_hook_reduces_the_shrink_across_ranks():
    check_row_parallel_hook("sparrow.lora.ops:add_lora", "float32")


def test_row_parallel_hook_with_the_triton_op_interpreted():
    pytest.importorskip("triton")
    code = ("from tests.test_lora_tp import check_row_parallel_hook as check; "
            "[check('sparrow_cuda.triton_lora:triton_add_lora', d) for d in ('float32', 'bfloat16')]")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr[-3000:]
