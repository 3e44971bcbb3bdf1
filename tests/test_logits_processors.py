"""Logits processors: the batch-update contract, the built-ins against a direct computation,
bad_words against HF transformers with the words banned by hand, and plugin processors enabled
by name (registered in-process, by qualified name in the engine's own process, through an entry
point in a fresh interpreter)."""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError
from sparrow.hookspecs import hookimpl
from sparrow.plugins import get_plugin_manager, get_registry, register_plugin
from sparrow.sample.logits_processor import BatchUpdate, LogitsProcessor, LogitsProcessors, process_dict_updates
from sparrow.sample.logits_processor.state import layout_update
from sparrow.sample.logits_processor.words import bad_words_token_ids
from sparrow.sample.metadata import SamplingTensors
from sparrow.sample.sampler import Sampler
from sparrow.worker.input_batch import CachedRequestState, InputBatch

NEG_INF = float("-inf")


# -- processors used by the tests (importable by qualified name from the engine's process) ------
class TargetTokenProcessor(LogitsProcessor):
    """Rows whose request sets ``extra_args["target_token"]`` can only sample that token."""

    def __init__(self, config, device, is_pin_memory):
        self.targets: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"extra_args.target_token must be a non-negative token id, got {target!r}")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.targets, batch_update,
                             lambda params, _prompt, _output: (params.extra_args or {}).get("target_token"))

    def apply(self, logits):
        for row, target in self.targets.items():
            kept = logits[row, target].item()
            logits[row] = NEG_INF  # in place: the sampler hands processors a tensor it owns
            logits[row, target] = kept
        return logits


class TopTwoProcessor(LogitsProcessor):
    """Argmax-invariant: rows with ``extra_args["top_two"]`` keep only their two largest logits."""

    def __init__(self, config, device, is_pin_memory):
        self.rows: dict[int, bool] = {}
        self.calls = 0

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        process_dict_updates(self.rows, batch_update, lambda p, _prompt, _out: (p.extra_args or {}).get("top_two"))

    def apply(self, logits):
        self.calls += 1
        for row in self.rows:
            second = logits[row].topk(2).values[-1]
            logits[row] = logits[row].masked_fill(logits[row] < second, NEG_INF)
        return logits


class TargetTokenPlugin:
    @hookimpl
    def sparrow_register_logits_processors(self, register):
        register("target_token", TargetTokenProcessor)


@contextlib.contextmanager
def registered(plugin, name: str):
    pm = get_plugin_manager()
    register_plugin(pm, plugin, name)
    try:
        yield
    finally:
        pm.unregister(name=name)


# -- the batch-update contract ------------------------------------------------------------------
def replay(rows: dict[int, object], update: BatchUpdate | None) -> None:
    # The entry of a request is its live output list, so identities are compared.
    process_dict_updates(rows, update, lambda _params, _prompt, output: output)


def test_batch_updates_replay_every_change_of_the_persistent_batch():
    rng = random.Random(0)
    batch = InputBatch(max_num_reqs=8, max_model_len=16, max_num_blocks_per_req=2)
    rows: dict[int, object] = {}
    waiting = [CachedRequestState(f"r{i}", [1, 2], SamplingParams(), [], 0) for i in range(12)]
    for step in range(400):
        for _ in range(rng.randrange(4)):  # several changes between two steps, as in update_states
            if batch.num_reqs and (rng.random() < 0.5 or batch.num_reqs == batch.max_num_reqs):
                state = batch.states[rng.randrange(batch.num_reqs)]
                batch.remove(state.req_id)
                if rng.random() < 0.5:  # preempted and resumed later: a new state object
                    state = CachedRequestState(state.req_id, [1, 2], SamplingParams(), [], 0)
                waiting.append(state)
            elif waiting:
                batch.add(waiting.pop(rng.randrange(len(waiting))))
        update = batch.take_batch_update()
        replay(rows, update)
        assert {row: id(entry) for row, entry in rows.items()} == {
            row: id(state.output_token_ids) for row, state in enumerate(batch.states)}, f"step {step}"
        if update is not None:
            assert update.batch_size == batch.num_reqs
    assert batch.take_batch_update() is None  # nothing changed since the last call


def test_layout_updates_break_permutation_cycles_with_swaps():
    rng = random.Random(1)
    for _ in range(300):
        previous = [[] for _ in range(rng.randrange(1, 9))]
        current = [obj for obj in previous if rng.random() < 0.8] + [[] for _ in range(rng.randrange(3))]
        rng.shuffle(current)
        rows = dict(enumerate(previous))
        update = layout_update(previous, current, lambda row, obj: (row, SamplingParams(), [], obj))
        replay(rows, update)
        assert {row: id(obj) for row, obj in rows.items()} == {row: id(obj) for row, obj in enumerate(current)}
    update = layout_update([a := [], b := [], c := []], [c, a, b], lambda row, obj: None)
    assert [direction.name for _, _, direction in update.moved] == ["SWAP", "SWAP"]


# -- the built-ins against a direct computation ----------------------------------------------------
VOCAB = 40


def random_params(rng: random.Random) -> SamplingParams:
    kwargs: dict = {"temperature": rng.choice([0.0, 1.0]), "all_stop_token_ids": [rng.randrange(VOCAB)],
                    "stop_token_ids": [rng.randrange(VOCAB)]}
    if rng.random() < 0.4:
        kwargs["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randrange(1, 6))
    if rng.random() < 0.4:
        kwargs["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(3)}
    if rng.random() < 0.4:
        kwargs["min_tokens"] = rng.randrange(1, 5)
    if rng.random() < 0.4:
        kwargs["bad_words_token_ids"] = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))] for _ in range(3)]
    return SamplingParams(**kwargs)


def expected_logits(logits: torch.Tensor, states: list[CachedRequestState]) -> torch.Tensor:
    """One row at a time, straight from each request's parameters and output so far."""
    out = logits.clone()
    for row, state in enumerate(states):
        params, output = state.sampling_params, state.output_token_ids
        if params.allowed_token_ids is not None:
            for token_id in range(VOCAB):
                if token_id not in params.allowed_token_ids:
                    out[row, token_id] = NEG_INF
        for ids in params.bad_words_token_ids or []:
            prefix = ids[:-1]
            if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
                out[row, ids[-1]] = NEG_INF
        if len(output) < params.min_tokens:
            for token_id in set(params.stop_token_ids) | set(params.all_stop_token_ids):
                out[row, token_id] = NEG_INF
        for token_id, bias in (params.logit_bias or {}).items():
            out[row, token_id] += bias
    return out


def test_builtin_processors_match_a_direct_computation_as_the_batch_changes():
    rng = random.Random(2)
    batch = InputBatch(max_num_reqs=6, max_model_len=64, max_num_blocks_per_req=4)
    tensors = SamplingTensors(VOCAB, "cpu")
    version, masked_rows = -1, 0
    for step in range(120):
        if batch.num_reqs and rng.random() < 0.3:
            batch.remove(rng.choice(batch.req_ids))
        while batch.num_reqs < batch.max_num_reqs and rng.random() < 0.5:
            batch.add(CachedRequestState(f"s{step}-{batch.num_reqs}", [1], random_params(rng), [], 0))
        if not batch.num_reqs:
            continue
        if version != batch.version:
            update = batch.take_batch_update()
            if update is not None:
                tensors.update_batch([s.sampling_params for s in batch.states],
                                     [s.prompt_token_ids for s in batch.states], update)
            version = batch.version
        metadata = tensors.metadata([s.output_token_ids for s in batch.states])
        logits = torch.randn(batch.num_reqs, VOCAB, generator=torch.Generator().manual_seed(step))
        before = logits.clone()
        got = metadata.logits_processors.apply_non_argmax_invariant(logits, owned=False)
        assert torch.equal(logits, before), "the caller's logits were modified"
        assert torch.equal(got, expected_logits(logits, batch.states)), f"step {step}"
        masked_rows += int(torch.isinf(got).any(dim=1).sum())
        for state in batch.states:  # each request generates a token (the live lists grow)
            state.output_token_ids.append(rng.randrange(VOCAB))
    assert masked_rows > 100  # the processors had work to do


def test_argmax_invariant_processors_run_after_temperature_for_random_rows_only():
    top_two = TopTwoProcessor(None, torch.device("cpu"), False)
    params = [SamplingParams(temperature=0.0, extra_args={"top_two": True}),
              SamplingParams(temperature=1.0, extra_args={"top_two": True}), SamplingParams(temperature=1.0)]
    tensors = SamplingTensors(8, "cpu", LogitsProcessors([top_two]))
    tensors.update_batch(params * 500, [[1]] * 1500)
    logits = torch.tensor([[0.5, 3.0, 2.9, 2.8, 0.0, 0.0, 0.0, 0.1]]).expand(1500, -1).contiguous()
    sampled = Sampler(torch.Generator().manual_seed(0))(logits, tensors.metadata([[]] * 1500)).sampled_token_ids
    assert set(sampled[0::3].tolist()) == {1}  # greedy: the argmax
    assert set(sampled[1::3].tolist()) == {1, 2}  # only the two largest
    assert len(set(sampled[2::3].tolist())) > 3  # untouched rows sample widely
    greedy = SamplingTensors(8, "cpu", LogitsProcessors([top_two]))
    greedy.update_batch(params[:1], [[1]])
    calls = top_two.calls
    Sampler()(logits[:1], greedy.metadata([[]]))
    assert top_two.calls == calls  # an all-greedy batch never needs them


# -- bad_words ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir, local_files_only=True)


def test_bad_words_tokenize_with_and_without_a_leading_space(tokenizer):
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    for word in ("and", "of", "hello", "the", " cat"):
        bare, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        # vLLM's rule: the spaced form too when it is another word-start token of the same length.
        expected = [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
        assert bad_words_token_ids(tokenizer, [word], len(tokenizer)) == expected
    assert len(bad_words_token_ids(tokenizer, ["and"], len(tokenizer))) == 2
    with pytest.raises(ValueError, match=r"bad_words\[0\].*outside the vocabulary"):
        bad_words_token_ids(tokenizer, ["hello"], 100)
    for bad in ("the", [""], [" "], [3]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args={"x": object()})


@pytest.fixture(scope="module")
def hf_model(qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True)
    return model.eval()


def hf_greedy(model, prompt: list[int], max_tokens: int, banned: list[list[int]] = ()) -> list[int]:
    """Greedy tokens from HF's logits, with each banned sequence's last token set to -inf whenever
    the output so far ends with the rest of it."""
    output: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            for ids in banned:
                prefix = ids[:-1]
                if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
                    logits[ids[-1]] = NEG_INF
            output.append(int(logits.argmax()))
    return output


def one_token_word(tokenizer, tokens: list[int]) -> str:
    """A word that bad_words turns into one of ``tokens`` (the first such token after the first)."""
    return next(tokenizer.decode([t]) for t in tokens[1:]
                if [t] in bad_words_token_ids(tokenizer, [tokenizer.decode([t])], len(tokenizer)))


PROMPTS = ["The quick brown fox", "Once upon a time there", "1, 2, 3,"]
MAX_TOKENS = 8


def test_bad_words_in_generate_match_hf_with_the_words_banned(qwen3_dir, hf_model, tokenizer):
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    free = [hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    # Words the unconstrained outputs contain: a one-token word as text, a two-token sequence by ids.
    word = one_token_word(tokenizer, free[0])
    pair = free[1][2:4]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=[word]),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words_token_ids=[pair]),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    llm = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=256, num_kv_blocks=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    banned = [bad_words_token_ids(tokenizer, [word], len(tokenizer)), [pair], []]
    for output, prompt, bans, unbanned in zip(outputs, prompts, banned, free):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS, bans)
    assert outputs[0].outputs[0].token_ids != free[0] and outputs[1].outputs[0].token_ids != free[1]
    assert outputs[2].outputs[0].token_ids == free[2]


# -- plugin processors ------------------------------------------------------------------------------
def check_targets(outputs, targets, hf_model, prompts):
    for output, target, prompt in zip(outputs, targets, prompts):
        tokens = output.outputs[0].token_ids
        if target is None:
            assert tokens == hf_greedy(hf_model, prompt, MAX_TOKENS)
        else:
            assert tokens == [target] * MAX_TOKENS


def target_params(targets):
    return [SamplingParams(temperature=0.0 if t is None else 1.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                           extra_args=None if t is None else {"target_token": t}) for t in targets]


def test_sparrow_register_logits_processors(qwen3_dir, hf_model, tokenizer):
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    targets = [7, None, 1234]
    with registered(TargetTokenPlugin(), "target-token-plugin"):
        assert get_registry().logits_processors["target_token"] is TargetTokenProcessor
        llm = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=256, num_kv_blocks=64,
                  logits_processors=["target_token"])
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], target_params(targets), use_tqdm=False)
        with pytest.raises(ValueError, match="extra_args.target_token"):
            llm.generate("x", SamplingParams(extra_args={"target_token": "seven"}), use_tqdm=False)
    finally:
        llm.shutdown()
    check_targets(outputs, targets, hf_model, prompts)
    with pytest.raises(ConfigError, match="'logits_processors'.*unknown logits processor 'target_token'"):
        LLM(qwen3_dir, logits_processors=["target_token"])  # unregistered: refused before any process starts


def test_a_builtin_is_replaced_only_with_override():
    from sparrow.plugins import PluginError

    class Clash:
        @hookimpl
        def sparrow_register_logits_processors(self, register):
            register("bad_words", TargetTokenProcessor)

    class Override:
        @hookimpl
        def sparrow_register_logits_processors(self, register):
            register("bad_words", TargetTokenProcessor, override=True)

    with registered(Clash(), "clashing-processor"), pytest.raises(PluginError, match="'bad_words'.*clashing-processor"):
        get_registry()
    with registered(Override(), "overriding-processor"):
        assert get_registry().logits_processors["bad_words"] is TargetTokenProcessor


def test_a_processor_named_by_class_runs_in_the_engine_process(qwen3_dir, hf_model, tokenizer):
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    targets = [None, 42, 3]
    # A class is passed on as "tests.test_logits_processors:TargetTokenProcessor" and imported there.
    with LLM(qwen3_dir, dtype="float32", max_model_len=256, num_kv_blocks=64,
             logits_processors=[TargetTokenProcessor]) as llm:
        assert llm.llm_engine.config.model.logits_processors == ["tests.test_logits_processors:TargetTokenProcessor"]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], target_params(targets), use_tqdm=False)
    check_targets(outputs, targets, hf_model, prompts)


PLUGIN_MODULE = '''
from sparrow.hookspecs import hookimpl

@hookimpl
def sparrow_register_logits_processors(register):
    register("ep_target", "tests.test_logits_processors:TargetTokenProcessor")
'''
CHILD = textwrap.dedent('''
    import json, sys
    from sparrow import LLM, SamplingParams
    with LLM(sys.argv[1], dtype="float32", max_model_len=256, num_kv_blocks=64, logits_processors=["ep_target"]) as llm:
        params = SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"target_token": 11})
        print(json.dumps(llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids))
''')


def test_an_entry_point_plugin_is_found_in_the_engine_process(qwen3_dir, tmp_path):
    (tmp_path / "ep_target_plugin.py").write_text(PLUGIN_MODULE)
    dist = tmp_path / "ep_target_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-target-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[sparrow]\nep_target_plugin = ep_target_plugin\n")
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{sys.path[0]}"}
    env.pop("SPARROW_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, qwen3_dir], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [11] * 4


def test_logits_processors_engine_argument_and_flag(qwen3_dir):
    from sparrow.config import EngineConfig
    from sparrow.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "/m", "--logits-processors", "a", "pkg.mod:Cls"])
    assert args.logits_processors == ["a", "pkg.mod:Cls"]
    with pytest.raises(ConfigError, match="logits_processors"):
        EngineConfig.from_kwargs(logits_processors="a")

    def local():
        class Local(TargetTokenProcessor):
            pass
        return Local

    with pytest.raises(ConfigError, match="inside a function"):
        EngineConfig.from_kwargs(logits_processors=[local()])
    for name, phrase in (("no.such.module:X", "cannot be imported"), ("json:dumps", "not a logits processor class"),
                         ("nope", "unknown logits processor 'nope'; registered: none")):
        with pytest.raises(ConfigError, match=phrase):
            LLM(qwen3_dir, logits_processors=[name])

