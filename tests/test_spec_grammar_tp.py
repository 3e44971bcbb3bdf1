"""Speculative decoding with structured outputs and with tensor parallelism (small test model,
real engine, real tokenizer and grammars).

With a grammar, the scheduler keeps only the drafts the grammar accepts, the engine core sends one
mask per verified position and the verification masks every position: greedy outputs must be
those of the engine without speculation, valid for their grammar, with drafts accepted. With
tensor_parallel_size=2 (spawned workers, gloo), n-gram, draft-model and EAGLE speculation must give
the tokens of one rank without speculation, a grammar request among them.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sparrow import LLM, SamplingParams
from sparrow.sampling_params import StructuredOutputsParams
from sparrow.wire import SchedulerStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Chunked prefill (48-token steps), prefix caching, a cache small enough to preempt now and then.
ENGINE = dict(multiprocess=False, dtype="float32", max_model_len=256, max_num_batched_tokens=48,
              num_kv_blocks=16, enable_prefix_caching=True)
MAX_TOKENS = 96  # above the longest output the grammars below allow

# A list of repeated objects: its keys and separators repeat, so prompt lookup finds them.
PETS = {"type": "array", "minItems": 2, "maxItems": 4, "items": {
    "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["kind", "age"], "additionalProperties": False}}
PETS_PROMPT = 'pets as JSON: [{"kind": "cat", "age": 3}, {"kind": "dog", "age": 5}, {"kind": "cat", "age": 1}]'
REGEX = r"(ab|cd){3,6}-(yes|no)"
REGEX_PROMPT = "pattern: abababcd-yes cdcdab-no ababab-yes"
CHOICES = ["the quick brown fox", "the lazy dog sleeps", "a cat on the mat"]
CHOICE_PROMPT = "pick one: the quick brown fox, the lazy dog sleeps, a cat on the mat. answer:"
FREE_PROMPT = "the quick brown fox jumps over the lazy dog. " * 3
# Free text inside JSON: the random-weight model's own argmax is often allowed there, so a draft
# model (which drafts without the grammar) gets drafts through the cut.
TEXT = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}}, "required": ["text"],
        "additionalProperties": False}


def grammar_params(**kind) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=StructuredOutputsParams(**kind))


def grammar_batch() -> tuple[list[str], list[SamplingParams]]:
    prompts = [PETS_PROMPT, REGEX_PROMPT, CHOICE_PROMPT, PETS_PROMPT + " again:", FREE_PROMPT]
    params = [grammar_params(json=PETS), grammar_params(regex=REGEX), grammar_params(choice=CHOICES),
              grammar_params(json=json.dumps(PETS)), grammar_params(json=TEXT)]
    return prompts, params


def check_valid(texts: list[str]) -> None:
    jsonschema.validate(json.loads(texts[0]), PETS)
    assert re.fullmatch(REGEX, texts[1]), texts[1]
    assert texts[2] in CHOICES
    jsonschema.validate(json.loads(texts[3]), PETS)
    jsonschema.validate(json.loads(texts[4]), TEXT)


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def spec_counts(llm: LLM, before: SchedulerStats) -> tuple[int, int]:
    stats = llm.llm_engine.last_stats
    return (stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)


def engine_core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


@pytest.fixture(scope="module")
def base(qwen3_dir):
    llm = LLM(qwen3_dir, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def expected_grammar(base):
    prompts, params = grammar_batch()
    outputs = base.generate(prompts, params, use_tqdm=False)
    check_valid([output.outputs[0].text for output in outputs])
    return token_ids(outputs)


# -- the grammar's look-ahead over drafts ----------------------------------------------------------
@pytest.fixture(scope="module")
def grammar_tools(qwen3_dir):
    from sparrow.engine.setup import load_tokenizer, model_eos_token_ids
    from sparrow.model_loader import get_hf_config
    from sparrow.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(qwen3_dir, vocab_size=int(get_hf_config(qwen3_dir).vocab_size),
                                      stop_token_ids=model_eos_token_ids(qwen3_dir))
    yield manager, load_tokenizer(qwen3_dir)
    manager.shutdown()


def ready(manager, params: StructuredOutputsParams):
    request = manager.new_request(params)
    request._compiled.result(timeout=60)
    assert request.is_ready()
    return request


def test_drafts_are_cut_to_the_grammar_and_masked_per_position(grammar_tools):
    import xgrammar

    manager, tokenizer = grammar_tools
    params = StructuredOutputsParams(choice=CHOICES)
    request = ready(manager, params)
    answer = tokenizer.encode(CHOICES[1], add_special_tokens=False)
    assert request.accept_tokens("r", answer[:1])  # "the": two choices remain
    eos = tokenizer.eos_token_id
    wrong = tokenizer.encode(" fox", add_special_tokens=False)[0]
    rest = answer[1:]
    # A draft the grammar rejects ends the usable ones; so does one after the end of the grammar.
    assert request.validate_tokens(rest + [wrong, eos]) == rest
    assert request.validate_tokens(rest + [eos, rest[0]]) == rest + [eos]
    assert request.validate_tokens([wrong] + rest) == []

    drafts = rest + [eos, rest[0]]
    rows = xgrammar.allocate_token_bitmask(len(drafts) + 1, manager.vocab_size)
    request.fill_with_drafts(rows, 0, drafts)
    # Row j: what a matcher that accepted drafts 1..j allows (built step by step on another request).
    reference = ready(manager, params)
    reference.accept_tokens("r", answer[:1])
    expected = xgrammar.allocate_token_bitmask(len(drafts) + 1, manager.vocab_size)
    for j in range(len(rest) + 1):
        reference.fill(expected, j)
        if j < len(rest):
            assert reference.accept_tokens("r", [rest[j]])
    assert rows[: len(rest) + 1].tolist() == expected[: len(rest) + 1].tolist()
    assert bool((expected[len(rest)] != -1).any())  # the last mask restricts: only EOS is left
    # After the grammar's end every token is allowed: the request stops there, the row is unused.
    assert rows[len(rest) + 1 :].tolist() == [[-1] * rows.shape[1]] * (len(drafts) - len(rest))
    # The walk left the request's state where it was: it still accepts the rest of its answer.
    assert request.validate_tokens(rest) == rest
    assert request.accept_tokens("r", rest + [eos]) and request.is_terminated()


def test_drafts_through_the_end_of_reasoning_restore_the_reasoning_state(grammar_tools):
    import types

    import xgrammar

    manager, tokenizer = grammar_tools
    request = ready(manager, StructuredOutputsParams(choice=CHOICES))
    end = 7  # stands for </think>: the grammar applies from the token after it
    request._manager = types.SimpleNamespace(reasoner=types.SimpleNamespace(ends_reasoning=lambda t: t == end))
    request._reasoning = True
    answer = tokenizer.encode(CHOICES[2], add_special_tokens=False)
    wrong = tokenizer.encode(" fox", add_special_tokens=False)[0]
    # Anything goes while reasoning; after the end token the grammar decides.
    assert request.validate_tokens([wrong, end, *answer[:2], wrong]) == [wrong, end, *answer[:2]]
    assert request.reasoning
    rows = xgrammar.allocate_token_bitmask(4, manager.vocab_size)
    request.fill_with_drafts(rows, 0, [wrong, end, answer[0]])
    assert rows[:2].tolist() == [[-1] * rows.shape[1]] * 2  # the reasoning's positions: any token
    expected = xgrammar.allocate_token_bitmask(2, manager.vocab_size)
    reference = ready(manager, StructuredOutputsParams(choice=CHOICES))
    reference.fill(expected, 0)
    reference.accept_tokens("r", answer[:1])
    reference.fill(expected, 1)
    assert rows[2:].tolist() == expected.tolist()
    assert request.reasoning and request.validate_tokens(answer) == answer


# -- the engine with a grammar and drafts -------------------------------------------------------------
def record_scheduled_drafts(llm: LLM, seen: list) -> None:
    """Wrap the engine core's bitmask fill to record, per grammar, whether every draft it was
    sent with is one its grammar accepts (the scheduler's cut)."""
    manager = engine_core(llm).structured_output_manager()
    fill = manager.fill_bitmask

    def recording(grammars, drafts=None):
        for grammar, grammar_drafts in zip(grammars, drafts or [[]] * len(grammars)):
            if grammar_drafts:
                seen.append(grammar.validate_tokens(grammar_drafts) == grammar_drafts)
        return fill(grammars, drafts)

    manager.fill_bitmask = recording


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_grammar_requests_speculate_and_keep_their_greedy_tokens(method, qwen3_dir, base, expected_grammar):
    # draft_model: the target as its own draft proposes its unconstrained argmax, which the grammar
    # often rejects: the cut and the per-position masks are exercised on every step. Only the free
    # text of TEXT lets such drafts through, so TEXT must get draft blocks in this small cache
    # (it once did not, when the draft's cache neither shared prefixes nor had room for the fed
    # drafts). The grammars are compiled beforehand (one token each), so the schedule does not
    # depend on when their compiles finish in the child processes.
    config = NGRAM if method == "ngram" else {"method": "draft_model", "model": qwen3_dir, "num_speculative_tokens": 3}
    llm = LLM(qwen3_dir, speculative_config=config, **ENGINE)
    try:
        seen: list[bool] = []
        record_scheduled_drafts(llm, seen)
        prompts, params = grammar_batch()
        llm.generate(prompts, [param.clone(max_tokens=1) for param in params], use_tqdm=False)
        before = llm.llm_engine.last_stats or SchedulerStats()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(outputs) == expected_grammar
        check_valid([output.outputs[0].text for output in outputs])
        drafted, accepted = spec_counts(llm, before)
        assert 0 < accepted <= drafted, (drafted, accepted)
        assert seen and all(seen)
        # Mixed with unconstrained requests, which keep their own drafts and tokens.
        free = SamplingParams(max_tokens=32, temperature=0)
        mixed = [FREE_PROMPT, *prompts]
        expected_free = token_ids(base.generate([FREE_PROMPT], free, use_tqdm=False))
        got = token_ids(llm.generate(mixed, [free, *params], use_tqdm=False))
        assert got == expected_free + expected_grammar
        stats = llm.llm_engine.last_stats
        assert stats.num_preemptions > 0  # requests were preempted and resumed with their grammar
        assert stats.prefix_cache_hits > 0
        assert stats.num_free_blocks == stats.num_total_blocks  # every block (drafts' too) came back
    finally:
        llm.shutdown()


def test_seeded_grammar_requests_reproduce_with_speculation(qwen3_dir, base):
    llm = LLM(qwen3_dir, speculative_config=NGRAM, **ENGINE)
    try:
        prompts, _ = grammar_batch()
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7 + index,
                                 structured_outputs=p.structured_outputs)
                  for index, p in enumerate(grammar_batch()[1])]
        expected = token_ids(base.generate(prompts, params, use_tqdm=False))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(outputs) == expected
        check_valid([output.outputs[0].text for output in outputs])
    finally:
        llm.shutdown()


# -- tensor parallelism ---------------------------------------------------------------------------
TP_PROMPTS = [FREE_PROMPT, "def add(a, b):\n    return a + b\n" * 3, "Once upon a time there was", PETS_PROMPT]


def tp_params() -> list[SamplingParams]:
    free = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    return [free, free, free, grammar_params(json=PETS)]


@pytest.fixture(scope="module")
def expected_tp(base):
    return token_ids(base.generate(TP_PROMPTS, tp_params(), use_tqdm=False))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_tp2_speculation_gives_the_tokens_of_tp1(method, qwen3_dir, expected_tp, tmp_path):
    if method == "ngram":
        config = NGRAM
    elif method == "draft_model":
        from sparrow.tiny.draft import build_draft_dir

        # The target's first layer: sharded over the two ranks like the target.
        draft = str(build_draft_dir(qwen3_dir, tmp_path / "draft", num_layers=1))
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    else:
        from sparrow.tiny.eagle import build_eagle_dir

        head = str(build_eagle_dir(qwen3_dir, tmp_path / "eagle"))
        config = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    llm = LLM(qwen3_dir, tensor_parallel_size=2, speculative_config=config, **ENGINE)
    try:
        before = llm.llm_engine.last_stats or SchedulerStats()
        outputs = llm.generate(TP_PROMPTS, tp_params(), use_tqdm=False)
        assert token_ids(outputs) == expected_tp
        jsonschema.validate(json.loads(outputs[-1].outputs[0].text), PETS)
        drafted, accepted = spec_counts(llm, before)
        assert 0 < accepted <= drafted, (drafted, accepted)
    finally:
        llm.shutdown()
