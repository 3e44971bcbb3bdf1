"""KV eviction policies: each built-in's order, uncached blocks first under every policy, the
registration hook and the ``kv_eviction_policy`` setting, and an out-of-tree policy that changes
the prefix-cache hit rate of the real engine."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.config import ConfigError, EngineConfig
from sparrow.core.block_pool import BlockPool
from sparrow.core.eviction import EvictionPolicy, LFUPolicy, LRUPolicy
from sparrow.core.kv_cache_manager import KVCacheManager
from sparrow.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, update_request_block_hashes
from sparrow.core.request import Request
from sparrow.engine.preflight import check_plugin_names
from sparrow.hookspecs import hookimpl
from sparrow.plugins import PluginError, get_plugin_manager, get_registry
from sparrow.sampling_params import SamplingParams
from tests.test_hooks import engine_with, registered
from tests.test_out_of_tree_plugins import child_env, pip_installed, sparrow_plugins_output

BLOCK_SIZE = 4


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def cached_blocks(num_blocks: int) -> list[KVCacheBlock]:
    # Any hash will do for the queue: it only asks whether there is one.
    return [KVCacheBlock(block_id, block_hash=bytes([block_id]) * 32) for block_id in range(num_blocks)]


def drain(policy: EvictionPolicy) -> list[int]:
    return [policy.pop().block_id for _ in range(len(policy))]


# -- each policy's order --------------------------------------------------------------------------
def test_lru_pops_least_recently_pushed_and_removes_from_the_middle():
    blocks = cached_blocks(5)
    policy = LRUPolicy()
    for block_id in (3, 0, 4, 1, 2):
        policy.push(blocks[block_id])
    policy.remove(blocks[4])
    assert ids(policy.blocks_in_order()) == [3, 0, 1, 2]
    assert drain(policy) == [3, 0, 1, 2]
    with pytest.raises(IndexError):
        policy.pop()


def test_lfu_evicts_the_least_used_then_the_least_recently_freed():
    blocks = cached_blocks(4)
    policy = LFUPolicy(4)
    for _ in range(3):
        policy.on_hit(blocks[0])  # reused by three more requests
    policy.on_hit(blocks[2])
    for block in blocks:
        policy.push(block)
    # priorities (age 0): 1 + uses -> block 0: 4, 1: 1, 2: 2, 3: 1; ties go least recently freed first
    assert ids(policy.blocks_in_order()) == [1, 3, 2, 0]
    assert drain(policy) == [1, 3, 2, 0]


def test_lfu_ages_out_a_block_that_was_hot_long_ago():
    """Dynamic aging: every eviction raises the floor, so a once-hot block that is never used again
    loses to fresh blocks after a while instead of holding its slot forever."""
    blocks = cached_blocks(8)
    policy = LFUPolicy(8)
    for _ in range(2):
        policy.on_hit(blocks[0])
    policy.push(blocks[0])  # priority 3
    evicted = []
    for block in blocks[1:]:  # one-off blocks, one freed per eviction
        policy.push(block)
        evicted.append(policy.pop().block_id)
    assert evicted[:2] == [1, 2], "fresh one-off blocks go before the hot one at first"
    assert 0 in evicted, "but the age catches up with a block nobody uses any more"


def test_lfu_forgets_the_uses_of_evicted_content():
    blocks = cached_blocks(2)
    policy = LFUPolicy(2)
    for _ in range(5):
        policy.on_hit(blocks[0])
    policy.push(blocks[0])
    assert policy.pop() is blocks[0]  # evicted: block 0 now holds new content
    policy.push(blocks[0])
    policy.push(blocks[1])
    assert drain(policy) == [0, 1], "the new content starts with no uses"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "remove", "pop", "hit"]), st.integers(0, 11)), max_size=300))
def test_lfu_matches_a_sorted_model_under_lazy_deletion(operations):
    """Random push / remove / pop / hit sequences against a brute-force model of LFU-DA; removals
    leave stale heap entries (and trigger rebuilds) that must never come back."""
    class EagerRebuild(LFUPolicy):
        __slots__ = ()
        STALE_FACTOR, STALE_SLACK = 1, 0  # rebuild often, so rebuilds are exercised too

    blocks = cached_blocks(12)
    policy = EagerRebuild(12)
    held: dict[int, tuple[int, int]] = {}  # block id -> (priority, push number)
    uses = [0] * 12
    age = pushes = 0
    for operation, block_id in operations:
        if operation == "push" and block_id not in held:
            pushes += 1
            held[block_id] = (age + 1 + uses[block_id], pushes)
            policy.push(blocks[block_id])
        elif operation == "remove" and block_id in held:
            del held[block_id]
            policy.remove(blocks[block_id])
        elif operation == "pop" and held:
            victim = min(held, key=held.__getitem__)
            age = held.pop(victim)[0]
            uses[victim] = 0
            assert policy.pop().block_id == victim
        elif operation == "hit" and block_id not in held:
            uses[block_id] += 1
            policy.on_hit(blocks[block_id])
        assert len(policy) == len(held)
    assert ids(policy.blocks_in_order()) == sorted(held, key=held.__getitem__)


@pytest.mark.parametrize("policy_cls", [LRUPolicy, LFUPolicy])
def test_blocks_without_cached_content_go_first_under_every_policy(policy_cls):
    blocks = cached_blocks(3) + [KVCacheBlock(block_id) for block_id in range(3, 6)]
    queue = FreeKVCacheBlockQueue(policy=policy_cls(6))
    for block_id in (0, 3, 1, 4, 2, 5):  # cached and uncached interleaved in free order
        queue.append(blocks[block_id])
    assert queue.num_free_blocks == len(queue) == 6
    assert ids(queue.popleft_n(3)) == [3, 4, 5]
    queue.remove(blocks[1])
    assert not queue.contains(blocks[1]) and queue.contains(blocks[2])
    assert ids(queue.popleft_n(2)) == [0, 2]
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def admit(manager: KVCacheManager, prompt: list[int], request_id: str) -> tuple[Request, list[int]]:
    """Compute the whole prompt in one step, as the scheduler would; the request and its block ids."""
    request = Request(request_id, prompt, SamplingParams())
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hit_blocks)
    request.num_computed_tokens = request.num_tokens
    return request, manager.get_block_ids(request_id)


def test_a_finished_requests_uncached_tail_is_reused_before_older_cached_blocks():
    """LRU used to queue a request's partial last block behind every older cached block; reusing it
    costs nothing, so it now goes first and the older prefix stays cached."""
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    first, _ = admit(manager, list(range(8)), "first")  # two full blocks, both cached
    manager.free(first)
    second, second_ids = admit(manager, list(range(100, 106)), "second")  # one full block, one partial
    manager.free(second)
    pool = manager.block_pool
    assert len(pool.get_new_blocks(2)) == 2  # the two blocks never used
    assert ids(pool.get_new_blocks(1)) == [second_ids[1]]  # then the partial block, not first's tail
    again = Request("again", list(range(8)) + [1], SamplingParams())
    assert manager.get_computed_blocks(again)[1] == 8


@pytest.mark.parametrize(("policy_cls", "expected_hit_tokens"), [(LRUPolicy, 0), (LFUPolicy, 8)])
def test_lfu_pool_keeps_a_reused_prefix_that_lru_evicts(policy_cls, expected_hit_tokens):
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, eviction_policy=policy_cls)
    hot = list(range(1000, 1008))  # two blocks
    for index in range(2):  # computed, then reused once
        manager.free(admit(manager, hot + [index], f"hot-{index}")[0])
    for index in range(3):  # one-off prompts of three blocks each: more than the free room
        manager.free(admit(manager, list(range(index * 100, index * 100 + 12)), f"one-off-{index}")[0])
    request = Request("hot-again", hot + [9], SamplingParams())
    assert manager.get_computed_blocks(request)[1] == expected_hit_tokens


def test_reset_prefix_cache_rebuilds_the_queue_with_a_fresh_policy():
    pool = BlockPool(4, eviction_policy=LFUPolicy)
    request = Request("a", list(range(8)), SamplingParams())
    update_request_block_hashes(request, 2)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, 0, 4, 2)
    pool.touch([blocks[0]])
    pool.free_blocks([blocks[0]])
    pool.free_blocks(blocks[::-1])
    old_policy = pool.free_block_queue.policy
    assert len(old_policy) == 4
    assert pool.reset_prefix_cache() is True
    assert pool.free_block_queue.policy is not old_policy and len(pool.free_block_queue.policy) == 0
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 0]  # the order of the moment
    assert all(block.block_hash is None for block in pool.blocks)
    assert ids(pool.get_new_blocks(4)) == [3, 2, 1, 0]


def test_block_pool_rejects_a_policy_that_is_not_one():
    with pytest.raises(TypeError, match="EvictionPolicy"):
        BlockPool(4, eviction_policy=dict)


# -- registration and configuration -----------------------------------------------------------------
class MostRecentFirst(EvictionPolicy):
    """MRU: the opposite of LRU, easy to tell apart."""

    def __init__(self, num_blocks: int) -> None:
        self._stack: list[KVCacheBlock] = []

    def __len__(self) -> int:
        return len(self._stack)

    def push(self, block: KVCacheBlock) -> None:
        self._stack.append(block)

    def remove(self, block: KVCacheBlock) -> None:
        self._stack.remove(block)

    def pop(self) -> KVCacheBlock:
        return self._stack.pop()

    def blocks_in_order(self) -> list[KVCacheBlock]:
        return self._stack[::-1]


class MruPlugin:
    @hookimpl
    def sparrow_register_kv_eviction_policies(self, register):
        register("mru", MostRecentFirst)


def test_sparrow_register_kv_eviction_policies_selects_a_policy_by_name():
    assert {"lru", "lfu"} <= set(get_registry().kv_eviction_policies)
    assert "mru" not in get_registry().kv_eviction_policies
    with registered(MruPlugin(), "mru-plugin"):
        assert get_registry().kv_eviction_policies["mru"] is MostRecentFirst
        core = engine_with(kv_eviction_policy="mru", enable_prefix_caching=True)
        pool = core.kv_cache_manager.block_pool
        assert pool.eviction_policy_cls is MostRecentFirst
        assert isinstance(pool.free_block_queue.policy, MostRecentFirst)
    default = engine_with().kv_cache_manager.block_pool
    assert default.eviction_policy_cls is LRUPolicy


def test_a_policy_name_registered_twice_needs_override():
    class Again:
        @hookimpl
        def sparrow_register_kv_eviction_policies(self, register):
            register("lru", MostRecentFirst)

    class Override:
        @hookimpl
        def sparrow_register_kv_eviction_policies(self, register):
            register("lru", MostRecentFirst, override=True)

    with registered(Again(), "again"), pytest.raises(PluginError, match="kv eviction policy 'lru'"):
        get_registry()
    with registered(Override(), "override"):
        assert get_registry().kv_eviction_policies["lru"] is MostRecentFirst


def test_unknown_policy_is_a_config_error_naming_the_field_and_the_choices():
    config = EngineConfig.from_kwargs(kv_eviction_policy="nope")
    with pytest.raises(ConfigError, match=r"'kv_eviction_policy'.*'nope'.*registered: lfu, lru"):
        check_plugin_names(config, get_registry(get_plugin_manager()))
    from sparrow import LLM

    with pytest.raises(ConfigError, match="kv_eviction_policy"):
        LLM(kv_eviction_policy="nope", multiprocess=False)


# -- out-of-tree, through the engine ------------------------------------------------------------
def hot_prefix_workload(num_rounds: int = 6, seed: int = 0) -> list[list[int]]:
    """Two hot system prompts (3 blocks of 16 tokens each), each used by two requests in a row,
    then three one-off prompts of 6 blocks: in a cache of 40 blocks the one-offs push the hot
    prefixes out of an LRU cache every round; a frequency-aware policy keeps them."""
    rng = random.Random(seed)
    hot = [[rng.randrange(1, 1000) for _ in range(48)] for _ in range(2)]
    prompts = []
    for _ in range(num_rounds):
        for prefix in hot:
            prompts += [prefix + [rng.randrange(1000, 2000) for _ in range(8)] for _ in range(2)]
            prompts += [[rng.randrange(2000, 4000) for _ in range(96)] for _ in range(3)]
    return prompts


HIT_RATES = textwrap.dedent("""
    import json, sys
    from sparrow import LLM, SamplingParams

    args = json.loads(sys.argv[1])
    rates = {}
    for name in args["policies"]:
        # One request at a time (max_num_seqs=1): the cache sees the workload in order.
        llm = LLM(args["model"], multiprocess=False, dtype="float32", max_model_len=256, block_size=16,
                  num_kv_blocks=args["num_kv_blocks"], max_num_seqs=1, kv_eviction_policy=name)
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
            stats = llm.llm_engine.last_stats
            rates[name] = stats.prefix_cache_hits / stats.prefix_cache_queries
        finally:
            llm.shutdown()
    print(json.dumps(rates))
""")


def engine_hit_rates(model: str, policies: list[str], num_kv_blocks: int = 40) -> dict[str, float]:
    args = {"model": model, "policies": policies, "prompts": hot_prefix_workload(), "num_kv_blocks": num_kv_blocks}
    proc = subprocess.run([sys.executable, "-c", HIT_RATES, json.dumps(args)], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.serial  # pip-installs a plugin into the environment
def test_out_of_tree_policy_raises_the_engines_hit_rate_on_hot_prefixes(qwen3_dir, tmp_path):
    get_plugin_manager()  # loaded before the install: this process must never see the package
    with pip_installed("sparrow_example_eviction", "sparrow-example-eviction", tmp_path):
        assert "slru" in next(line for line in sparrow_plugins_output().splitlines()
                              if line.startswith("kv eviction policies:"))
        rates = engine_hit_rates(qwen3_dir, ["lru", "lfu", "slru"])
    print(f"prefix-cache hit rate, hot-prefix workload, 40 blocks: {rates}")
    # Only the second request of each hot pair hits under LRU; both hit once the prefix is kept.
    assert rates["slru"] > rates["lru"] + 0.05
    assert rates["lfu"] > rates["lru"] + 0.05


# -- the ablation axis --------------------------------------------------------------------------
def hot_prefix_trace(path, num_rounds: int = 4) -> None:
    """The ablation's workload as a trace: four hot 128-token system prompts, each used by two
    requests, then three one-off 256-token prompts, round after round."""
    lines = []
    for _ in range(num_rounds):
        for group in range(4):
            lines += [{"arrival_s": 0.0, "prompt_len": 136, "output_len": 8, "prefix_group": f"system-{group}",
                       "prefix_len": 128}] * 2
            lines += [{"arrival_s": 0.0, "prompt_len": 256, "output_len": 8}] * 3
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_ablate_compares_eviction_policies_on_the_simulated_device(tmp_path):
    from sparrow.entrypoints.cli import main

    trace = tmp_path / "hot.jsonl"
    hot_prefix_trace(trace)
    out_dir = tmp_path / "ablate"
    assert main(["bench", "ablate", "--device", "sim", "--trace", str(trace), "--kv-eviction-policies", "lru,lfu",
                 "--engine-args", json.dumps({"num_kv_blocks": 200, "max_num_seqs": 4}),
                 "--output-dir", str(out_dir)]) == 0
    report = json.loads((out_dir / "results.json").read_text())
    assert report["axes"]["kv_eviction_policy"] == ["lru", "lfu"]
    lru, lfu = report["points"]
    assert (lru["label"], lfu["label"]) == ("evict=lru", "evict=lfu")
    assert lfu["prefix_cache_hit_rate"] > lru["prefix_cache_hit_rate"] + 0.03
