"""The KV cache for sliding windows: blocks that slid out of every layer's window are freed,
prefix caching stays correct, and a hybrid cache (sliding and full-attention layers) gives each
kind of layer its own block table, so the sliding layers do not hold the whole context.

The manager and the scheduler are driven directly (a checker plays the workers and verifies that
every slot written and every key read lies in a block the request still holds); the engine test
serves a context 8x the window through a real model and compares it with HF transformers.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from sparrow.core.kv_cache_utils import KVCacheGroupSpec, make_kv_cache_groups
from sparrow.core.request import Request
from sparrow.core.sched.scheduler import Scheduler
from sparrow.sampling_params import SamplingParams
from sparrow.wire import ModelRunnerOutput, SchedulerOutput

BLOCK_SIZE = 4
WINDOW = 8
SLIDING = [KVCacheGroupSpec(WINDOW, (0, 1))]
HYBRID = [KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(WINDOW, (0,))]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def step(manager: KVCacheManager, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
    """Schedule ``num_new_tokens`` of a running request, as the scheduler does."""
    blocks = manager.allocate_slots(request, num_new_tokens)
    if blocks is not None:
        request.num_computed_tokens += num_new_tokens
    return blocks


def admit(manager: KVCacheManager, request: Request, chunk: int) -> int:
    """Admit at the longest cached prefix and schedule one chunk; returns the hit tokens."""
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    num_new = min(chunk, request.num_tokens - num_hit)
    assert manager.allocate_slots(request, num_new, num_hit, hit_blocks) is not None
    request.num_computed_tokens = num_hit + num_new
    return num_hit


def check_pool(manager: KVCacheManager) -> None:
    """Every block is either free or held, ref_cnt counts its holders, the null block is neither."""
    pool = manager.block_pool
    holders: dict[int, int] = {}
    for group_manager in manager.managers:
        for blocks in group_manager.req_to_blocks.values():
            for block in blocks:
                if block is not pool.null_block:
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
    free = {block.block_id for block in pool.free_block_queue.get_all_free_blocks()}
    assert not free & holders.keys()
    assert len(free) + len(holders) == pool.num_usable_blocks
    for block_id, count in holders.items():
        assert pool.blocks[block_id].ref_cnt == count
    if pool.null_block is not None:
        assert pool.null_block.block_id not in free and pool.null_block.block_hash is None


# -- grouping ----------------------------------------------------------------------------------
def test_layers_group_by_window_in_groups_of_equal_size() -> None:
    assert make_kv_cache_groups([None, None]) == [KVCacheGroupSpec(None, (0, 1))]
    assert make_kv_cache_groups([16, 16, 16]) == [KVCacheGroupSpec(16, (0, 1, 2))]
    # A window covering max_model_len is full attention.
    assert make_kv_cache_groups([16, None], max_model_len=16) == [KVCacheGroupSpec(None, (0, 1))]
    # Gemma 2 alternates; Gemma 3 has five sliding layers per global one.
    assert make_kv_cache_groups([8, None, 8, None]) == [KVCacheGroupSpec(None, (1, 3)), KVCacheGroupSpec(8, (0, 2))]
    gemma3 = make_kv_cache_groups([8, 8, 8, 8, 8, None])
    assert [group.sliding_window for group in gemma3] == [None, 8, 8, 8, 8, 8]
    assert all(len(group.layer_indices) == 1 for group in gemma3)
    uneven = make_kv_cache_groups([8, 8, 8, None, None])
    assert uneven == [KVCacheGroupSpec(None, (3, 4)), KVCacheGroupSpec(8, (0, 1)), KVCacheGroupSpec(8, (2,))]


# -- the sliding-window manager ------------------------------------------------------------------
def test_decode_frees_blocks_that_slid_out_of_the_window() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, kv_cache_groups=SLIDING)
    null_id = manager.block_pool.null_block.block_id
    request = make_request("r", list(range(6)), max_tokens=200)
    admit(manager, request, chunk=64)
    for token in range(100):
        request.append_output_token_ids(1000 + token)
        assert step(manager, request, 1) is not None
        check_pool(manager)
        ids = manager.get_block_ids("r")
        # Index == position // block_size still holds; the slid-out prefix is the null block.
        assert len(ids) == cdiv(request.num_computed_tokens, BLOCK_SIZE)
        first_read = request.num_computed_tokens - 1 - WINDOW + 1  # the last token's first key
        assert null_id not in ids[max(0, first_read) // BLOCK_SIZE:]
        assert manager.get_num_blocks_held("r") <= cdiv(WINDOW - 1 + 1, BLOCK_SIZE) + 1
    assert ids.count(null_id) > 20
    manager.free(request)
    check_pool(manager)
    assert manager.num_free_blocks == manager.block_pool.num_usable_blocks == 15
    assert manager.usage == 0.0


def test_long_prompt_fits_a_cache_smaller_than_it_when_every_layer_slides() -> None:
    budget = 8
    sliding = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE, kv_cache_groups=SLIDING,
                             max_num_batched_tokens=budget)
    full = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE, max_num_batched_tokens=budget)
    assert sliding.can_fit(1000) and not full.can_fit(1000)
    # The bound can_fit promises holds for a chunked prefill followed by decoding.
    request = make_request("long", list(range(300)), max_tokens=50)
    admit(sliding, request, chunk=budget)
    while request.num_computed_tokens < request.num_tokens:
        assert step(sliding, request, min(budget, request.num_tokens - request.num_computed_tokens)) is not None
        assert sliding.get_num_blocks_held("long") <= cdiv(WINDOW - 1 + budget, BLOCK_SIZE) + 1
    check_pool(sliding)
    # A hybrid cache needs the whole context for its full-attention group.
    hybrid = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE, kv_cache_groups=HYBRID,
                            max_num_batched_tokens=budget)
    assert hybrid.can_fit(100) and not hybrid.can_fit(150)


def test_sliding_prefix_hit_needs_only_the_window_before_the_hit() -> None:
    manager = KVCacheManager(num_blocks=24, block_size=BLOCK_SIZE, kv_cache_groups=SLIDING)
    null_block = manager.block_pool.null_block
    prompt = list(range(40))  # 10 blocks
    first = make_request("first", prompt)
    admit(manager, first, chunk=40)
    # 40 tokens computed: the next token reads positions 33..40, so blocks 0..7 slid out.
    first.append_output_token_ids(7)
    step(manager, first, 1)
    assert [block is null_block for block in manager.get_blocks("first").blocks] == [True] * 8 + [False] * 3
    manager.free(first)
    # 23 usable blocks: 12 never used and the prompt's partial last block (no cached content, so
    # reused first), then the prompt's slid-out ones, oldest first. A filler of 14 blocks takes
    # those 13 and evicts the prompt's first block.
    filler = make_request("filler", list(range(500, 556)))
    admit(manager, filler, chunk=56)
    assert manager.block_pool.get_cached_block(first.block_hashes[0]) is None

    again = make_request("again", prompt + [99, 98])
    hit_blocks, num_hit = manager.get_computed_blocks(again)
    # The hit ends at 40 tokens; only the blocks holding keys 33..39 must be cached.
    assert num_hit == 40
    num_window_blocks = cdiv(WINDOW - 1, BLOCK_SIZE)
    assert all(block is null_block for block in hit_blocks.blocks[:10 - num_window_blocks])
    assert all(block.block_hash == first.block_hashes[index]
               for index, block in enumerate(hit_blocks.blocks) if index >= 10 - num_window_blocks)
    # A full-attention cache would have missed: its first block is gone.
    assert manager.allocate_slots(again, 2, num_hit, hit_blocks) is not None
    check_pool(manager)


def test_sliding_prefix_hit_breaks_where_the_window_is_not_cached() -> None:
    manager = KVCacheManager(num_blocks=24, block_size=BLOCK_SIZE, kv_cache_groups=SLIDING)
    prompt = list(range(40))
    first = make_request("first", prompt)
    admit(manager, first, chunk=40)
    manager.free(first)
    # Evict block 8 only: hits must end before it or after it with a full window behind them.
    manager.block_pool._evict_cached_content(manager.block_pool.get_cached_block(first.block_hashes[8]))
    hit_blocks, num_hit = manager.get_computed_blocks(make_request("again", prompt + [1]))
    # Blocks 6, 7 are cached (the window of a hit at 8 blocks = 32 tokens); 8 is not; 9 is but
    # its window (8, 9) is not whole.
    assert num_hit == 32
    assert len(hit_blocks.blocks) == 8


# -- the hybrid cache ------------------------------------------------------------------------
def test_hybrid_groups_hold_their_own_blocks_from_one_pool() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, kv_cache_groups=HYBRID)
    request = make_request("r", list(range(10)), max_tokens=100)
    admit(manager, request, chunk=10)
    full_ids, (sliding_ids,) = manager.get_block_ids("r"), manager.get_extra_group_block_ids("r")
    assert len(full_ids) == len(sliding_ids) == 3 and not set(full_ids) & set(sliding_ids)
    for token in range(60):
        request.append_output_token_ids(token)
        new_blocks = step(manager, request, 1)
        assert new_blocks is not None and len(new_blocks.extra_groups) == 1
        check_pool(manager)
    full_blocks, (sliding_blocks,) = manager.get_blocks("r").blocks, manager.get_blocks("r").extra_groups
    null_block = manager.block_pool.null_block
    assert null_block not in full_blocks and len(full_blocks) == cdiv(70, BLOCK_SIZE)
    held_sliding = [block for block in sliding_blocks if block is not null_block]
    assert len(held_sliding) <= cdiv(WINDOW, BLOCK_SIZE) + 1
    assert manager.get_num_blocks_held("r") == len(full_blocks) + len(held_sliding)
    manager.free(request)
    check_pool(manager)
    assert manager.usage == 0.0


def test_hybrid_prefix_hit_is_a_hit_in_every_group() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, kv_cache_groups=HYBRID)
    prompt = list(range(40))
    first = make_request("first", prompt)
    admit(manager, first, chunk=40)
    manager.free(first)
    pool = manager.block_pool
    # Group 0 (full attention) keeps blocks 0..5 only; the sliding group keeps everything but
    # block 4, so a hit at 6 blocks lacks its window: the groups agree on 4 blocks.
    for index in range(6, 10):
        pool._evict_cached_content(pool.get_cached_block(first.block_hashes[index]))
    sliding = manager.managers[1]
    sliding_block_4 = sliding.find_longest_cache_hit(first.block_hashes, 5)[4]
    pool._evict_cached_content(sliding_block_4)
    hit_blocks, num_hit = manager.get_computed_blocks(make_request("again", prompt + [5]))
    assert num_hit == 16
    assert len(hit_blocks.blocks) == len(hit_blocks.extra_groups[0]) == 4
    # Full-attention hits are keyed by the bare hash (what connectors read); the sliding group's not.
    assert [block.block_hash for block in hit_blocks.blocks] == first.block_hashes[:4]
    assert all(block.block_hash not in first.block_hashes for block in hit_blocks.extra_groups[0]
               if block is not pool.null_block)


def test_random_workload_keeps_the_pool_consistent() -> None:
    rng = random.Random(0)
    for groups in (SLIDING, HYBRID, [KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(4, (1,)),
                                     KVCacheGroupSpec(12, (2,))]):
        manager = KVCacheManager(num_blocks=48, block_size=BLOCK_SIZE, kv_cache_groups=groups,
                                 max_num_batched_tokens=8)
        running: list[Request] = []
        for index in range(300):
            if running and rng.random() < 0.15:
                manager.free(running.pop(rng.randrange(len(running))))
            elif rng.random() < 0.3 or not running:
                prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
                request = make_request(f"r{index}", prompt)
                hit_blocks, num_hit = manager.get_computed_blocks(request)
                num_new = min(8, request.num_tokens - num_hit)
                if manager.allocate_slots(request, num_new, num_hit, hit_blocks) is not None:
                    request.num_computed_tokens = num_hit + num_new
                    running.append(request)
            else:
                request = rng.choice(running)
                if request.num_computed_tokens == request.num_tokens:
                    request.append_output_token_ids(rng.randrange(3))
                step(manager, request, min(8, request.num_tokens - request.num_computed_tokens))
            check_pool(manager)
        for request in running:
            manager.free(request)
        check_pool(manager)
        assert manager.num_free_blocks == manager.block_pool.num_usable_blocks


# -- through the scheduler ---------------------------------------------------------------------
class WindowChecker:
    """Plays the workers from the scheduler's messages alone (block tables per group, as the
    model runner keeps them). It "writes" into each slot the identity of the KV it would hold
    (the tokens up to that position: a key depends on its whole prefix) and checks that every
    key a step reads, through its own table, holds the key of its own prefix."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.windows = [group.sliding_window for group in manager.kv_cache_groups]
        self.tables: dict[str, list[list[int]]] = {}  # req_id -> per group block ids
        # Layer j of every group lives in KV cache tensor j: (tensor, slot) -> prefix written there
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.num_tensors = [len(group.layer_indices) for group in manager.kv_cache_groups]

    def execute(self, output: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        output = msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=SchedulerOutput)
        for req_id in output.finished_req_ids:
            self.tables.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            self.tables[new.req_id] = [list(new.block_ids)] + [list(ids) for ids in new.extra_group_block_ids]
        cached = output.scheduled_cached_reqs
        extra = cached.new_extra_group_block_ids or [[] for _ in cached.req_ids]
        for req_id, new_ids, extra_ids in zip(cached.req_ids, cached.new_block_ids, extra):
            for table, ids in zip(self.tables[req_id], [new_ids, *extra_ids]):
                table.extend(ids)
        null_id = self.manager.block_pool.null_block.block_id
        # Every write of the step lands before any read (a backend writes the new keys first).
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = requests[req_id]
            start = request.num_computed_tokens - num_new  # the scheduler already advanced it
            for group_id, table in enumerate(self.tables[req_id]):
                for position in range(start, start + num_new):
                    block_id = table[position // BLOCK_SIZE]
                    assert block_id != null_id, (req_id, group_id, position)
                    slot = block_id * BLOCK_SIZE + position % BLOCK_SIZE
                    for tensor in range(self.num_tensors[group_id]):
                        self.slots[tensor, slot] = tuple(request.all_token_ids[:position + 1])
        sampled = []
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = requests[req_id]
            start = request.num_computed_tokens - num_new
            for group_id, (table, window) in enumerate(zip(self.tables[req_id], self.windows)):
                for position in range(start, start + num_new):
                    first_key = 0 if window is None else max(0, position - window + 1)
                    for key in range(first_key, position + 1):
                        slot = table[key // BLOCK_SIZE] * BLOCK_SIZE + key % BLOCK_SIZE
                        for tensor in range(self.num_tensors[group_id]):
                            assert self.slots.get((tensor, slot)) == tuple(request.all_token_ids[:key + 1]), \
                                (req_id, group_id, position, key)
            sampled.append([len(request.all_token_ids) % 5] if request.num_computed_tokens >= request.num_tokens
                           else [])
        return ModelRunnerOutput(req_ids=list(output.num_scheduled_tokens), sampled_token_ids=sampled)


GEMMA3_LIKE = [KVCacheGroupSpec(None, (0,))] + [KVCacheGroupSpec(WINDOW, (layer,)) for layer in (1, 2, 3)]


@pytest.mark.parametrize(("groups", "num_blocks"), [(SLIDING, 8), (HYBRID, 40), (GEMMA3_LIKE, 50)],
                         ids=["sliding", "hybrid", "one-global-three-sliding"])
def test_scheduler_sends_each_group_its_blocks_and_never_reads_a_freed_one(groups, num_blocks) -> None:
    budget = 8
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, kv_cache_groups=groups,
                             max_num_batched_tokens=budget)
    scheduler = Scheduler(manager, max_num_seqs=3, max_num_batched_tokens=budget, max_model_len=512)
    checker = WindowChecker(manager)
    rng = random.Random(1)
    shared = [rng.randrange(50) for _ in range(24)]
    for index, length in enumerate([30, 70, 5, 45, 60]):
        prompt = shared + [rng.randrange(50) for _ in range(length)] if index % 2 else \
            [rng.randrange(50) for _ in range(length)]
        scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=20))
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        scheduler.update_from_output(output, checker.execute(output, scheduler.requests))
        check_pool(manager)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions > 0  # the cache cannot hold three of them at once
    assert manager.make_prefix_cache_stats().hits > 0
    check_pool(manager)


# -- through the engine, against HF transformers -----------------------------------------------
MODEL_WINDOW = 16
MODEL_BLOCK_SIZE = 8
MODEL_BUDGET = 16  # max_num_batched_tokens: chunked prefill


def window_bound_blocks() -> int:
    """What a request holds per sliding group at most: the window plus one step's tokens."""
    return cdiv(MODEL_WINDOW - 1 + MODEL_BUDGET, MODEL_BLOCK_SIZE) + 1


@pytest.fixture(scope="module")
def window_models(tmp_path_factory) -> dict[str, str]:
    """Mistral (every layer slides) and Qwen2 with max_window_layers=1 (layer 0 global, layers
    1..3 sliding: a hybrid cache of four one-layer groups sharing one tensor)."""
    from sparrow.tiny.model import build_model_dir

    root = tmp_path_factory.mktemp("window-models")
    return {
        "mistral": str(build_model_dir(root / "mistral", arch="mistral", preset="test", seed=5,
                                       sliding_window=MODEL_WINDOW, save_dtype="float32")),
        "qwen2": str(build_model_dir(root / "qwen2", arch="qwen2", preset="test", seed=6, num_hidden_layers=4,
                                     use_sliding_window=True, sliding_window=MODEL_WINDOW, max_window_layers=1,
                                     save_dtype="float32")),
    }


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list]]:
    """Argmax of HF's raw logits, one full forward per token (``generate`` with
    ``min_new_tokens`` would suppress EOS, which the engine's ``ignore_eos`` does not)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            sequence, logprobs = list(prompt), []
            for _ in range(max_tokens):
                step_logprobs = model(torch.tensor([sequence]), use_cache=False).logits[0, -1].float().log_softmax(-1)
                logprobs.append(step_logprobs)
                sequence.append(int(step_logprobs.argmax()))
            results.append((sequence[len(prompt):], logprobs))
    return results


def watch_blocks(llm):
    """The engine core's KV cache manager, and a dict that its allocations keep updated with the
    most blocks one request held and the most the pool had in use."""
    manager = llm.llm_engine.engine_core.engine_core.kv_cache_manager
    peak = {"request": 0, "pool": 0}
    allocate = manager.allocate_slots

    def allocate_and_record(request, *args, **kwargs):
        blocks = allocate(request, *args, **kwargs)
        peak["request"] = max(peak["request"], manager.get_num_blocks_held(request.request_id))
        peak["pool"] = max(peak["pool"], manager.block_pool.num_usable_blocks - manager.num_free_blocks)
        return blocks

    manager.allocate_slots = allocate_and_record
    return manager, peak


def generate_and_check(llm, prompts, reference, max_tokens):
    from sparrow import SamplingParams as Params

    params = Params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    for index, (output, (hf_tokens, hf_logprobs)) in enumerate(zip(outputs, reference)):
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt {index} differs from HF"
        for position, (token_id, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert abs(logprobs[token_id].logprob - hf_logprobs[position][token_id].item()) < 1e-3, (index, position)
    return outputs


def test_sliding_window_model_serves_8x_its_window_in_a_cache_bounded_by_the_window(window_models):
    from sparrow import LLM

    rng = random.Random(3)
    max_tokens = 28
    prompts = [[rng.randrange(4000) for _ in range(length)] for length in (100, 37, 5)]  # 128 = 8 x 16
    reference = hf_greedy(window_models["mistral"], prompts, max_tokens)
    # 7 blocks of 8 tokens (one the null block): 48 slots for a 128-token context, and for three
    # requests at once, so some are preempted.
    llm = LLM(window_models["mistral"], multiprocess=False, dtype="float32", max_model_len=512,
              block_size=MODEL_BLOCK_SIZE, num_kv_blocks=7, max_num_batched_tokens=MODEL_BUDGET)
    try:
        manager, peak = watch_blocks(llm)
        assert manager.num_kv_cache_groups == 1 and manager.kv_cache_groups[0].sliding_window == MODEL_WINDOW
        generate_and_check(llm, prompts, reference, max_tokens)
        assert peak["request"] <= window_bound_blocks() < cdiv(128, MODEL_BLOCK_SIZE)
        assert peak["pool"] <= 6 and manager.usage == 0.0
        assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
        # The same prompts again, through what the prefix cache kept: still HF's tokens.
        generate_and_check(llm, prompts, reference, max_tokens)
    finally:
        llm.shutdown()


def test_sliding_window_prefix_hit_reuses_only_the_window(window_models):
    from sparrow import LLM

    rng = random.Random(4)
    shared = [rng.randrange(4000) for _ in range(64)]
    prompts = [shared + [rng.randrange(4000) for _ in range(9)], shared + [rng.randrange(4000) for _ in range(20)]]
    reference = hf_greedy(window_models["mistral"], prompts, 6)
    llm = LLM(window_models["mistral"], multiprocess=False, dtype="float32", max_model_len=512,
              block_size=MODEL_BLOCK_SIZE, num_kv_blocks=64, max_num_batched_tokens=MODEL_BUDGET)
    try:
        generate_and_check(llm, prompts[:1], reference[:1], 6)
        (second,) = generate_and_check(llm, prompts[1:], reference[1:], 6)
        # The whole shared prefix is a hit though its early blocks slid out (and were freed).
        assert second.num_cached_tokens == 64
    finally:
        llm.shutdown()


def test_hybrid_model_keeps_only_the_window_for_its_sliding_layers(window_models):
    from sparrow import LLM

    rng = random.Random(5)
    max_tokens = 28
    prompts = [[rng.randrange(4000) for _ in range(length)] for length in (100, 30, 61)]
    reference = hf_greedy(window_models["qwen2"], prompts, max_tokens)
    llm = LLM(window_models["qwen2"], multiprocess=False, dtype="float32", max_model_len=512,
              block_size=MODEL_BLOCK_SIZE, num_kv_blocks=40, max_num_batched_tokens=MODEL_BUDGET)
    try:
        manager, peak = watch_blocks(llm)
        assert [group.sliding_window for group in manager.kv_cache_groups] == [None] + [MODEL_WINDOW] * 3
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        # Layer j of every group shares tensor j: four one-layer groups, one tensor.
        assert len({id(cache) for cache in runner.kv_caches}) == 1
        generate_and_check(llm, prompts, reference, max_tokens)
        full_blocks = cdiv(128, MODEL_BLOCK_SIZE)
        # The global layer holds the whole context, each sliding layer its window only.
        assert full_blocks < peak["request"] <= full_blocks + 3 * window_bound_blocks() < 4 * full_blocks
        generate_and_check(llm, prompts, reference, max_tokens)  # through the prefix cache
    finally:
        llm.shutdown()


def test_a_kv_connector_is_refused_for_a_sliding_window_model(window_models, tmp_path):
    from sparrow import LLM

    # The connector saves whole prefixes; blocks that slid out of the window are gone.
    with pytest.raises(ValueError, match="kv_connector"):
        LLM(window_models["mistral"], multiprocess=False, dtype="float32", max_model_len=512,
            kv_connector="shared_storage", kv_role="kv_both",
            kv_connector_extra_config={"storage_path": str(tmp_path)})
