"""Structured outputs offline: every constrained output is valid and ends with "stop", under a
random-weight model, at temperature 1.0 and greedy, in a batch that forces preemption and chunked
prefill; unconstrained neighbours are untouched. One module-scoped engine with a small KV cache.

Schemas are bounded (maxLength, maxItems, enums, integer ranges, small patterns), so every output
the grammar allows fits in max_tokens: a request that does not finish with "stop" is a failure.
"""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest
import torch

from sparrow import LLM
from sparrow.core.request import Request, RequestStatus
from sparrow.sample.sampler import apply_grammar_bitmask
from sparrow.sampling_params import SamplingParams, StructuredOutputsParams
from sparrow.structured_output.grammar import build_grammar, check_structured_outputs, grammar_key
from sparrow.worker.outputs import ModelRunnerOutput
from tests.test_scheduler import make_engine, make_request

MAX_TOKENS = 160  # above the longest output any grammar below allows
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "id": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["name", "id"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
               "minItems": 1, "maxItems": 4}}, "required": ["xs"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
}
REGEX = r"[a-z]{1,8}@(foo|bar)\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = '''root ::= "(" expr ")"
expr ::= num | num op num
op ::= "+" | "-"
num ::= [0-9] | [0-9] [0-9]'''
GRAMMAR_REGEX = r"\((\d{1,2}|\d{1,2}[+-]\d{1,2})\)"


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    # 20 blocks of 16 tokens for a batch needing several times that: requests are preempted and
    # recomputed; a 48-token budget splits the longer prompts into chunks.
    engine = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=256, num_kv_blocks=20,
                 max_num_batched_tokens=48)
    yield engine
    engine.shutdown()


def run(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[list, int]:
    """Step the engine by hand (to read the preemption counter): final outputs in order, preemptions."""
    engine = llm.llm_engine
    finals, num_preemptions = {}, 0
    for index, (prompt, sampling) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), prompt, sampling)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        num_preemptions += engine.last_stats.num_preemptions if engine.last_stats else 0
    return [finals[str(index)] for index in range(len(prompts))], num_preemptions


def constrained(seed: int | None, **kind) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=MAX_TOKENS,
                          structured_outputs=StructuredOutputsParams(**kind))


def prompt_of(rng: random.Random, length: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(length)]}


def check_valid(kind: str, spec, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    elif kind == "choice":
        assert text in spec, text
    else:
        assert re.fullmatch(GRAMMAR_REGEX, text), text


# -- parameters -------------------------------------------------------------------------------
def test_exactly_one_kind_and_bad_grammars_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar.*got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex and choice"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match=r"structured_outputs.choice\[1\]"):
        StructuredOutputsParams(choice=["a", ""])
    for kind, value in (("json", {"type": "no-such-type"}), ("regex", "([a-z"), ("grammar", "root ::= missing")):
        with pytest.raises(ValueError, match=f"structured_outputs.{kind} is invalid"):
            check_structured_outputs(StructuredOutputsParams(**{kind: value}))
    # The cache key does not depend on a dict's key order.
    assert grammar_key(StructuredOutputsParams(json={"a": 1, "b": 2})) == \
        grammar_key(StructuredOutputsParams(json={"b": 2, "a": 1}))


def test_json_grammars_allow_no_free_whitespace_unless_asked():
    from xgrammar.testing import _is_grammar_accept_string as accepts

    compact = build_grammar(StructuredOutputsParams(json=SCHEMAS["array"]))
    loose = build_grammar(StructuredOutputsParams(json=SCHEMAS["array"]), any_whitespace=True)
    assert accepts(compact, '{"xs": [1, -2]}') and accepts(loose, '{"xs": [1, -2]}')
    for spaced in ('{ "xs": [1, -2]}', '{"xs":  [1, -2]}', '{"xs": [1,\n -2]}'):
        assert not accepts(compact, spaced) and accepts(loose, spaced)
    # A length-bounded string holds no raw control character (invalid JSON), however short.
    bounded = build_grammar(StructuredOutputsParams(json=SCHEMAS["nested"]))
    assert accepts(bounded, '{"user": {"name": "ab", "id": 7}, "ok": true}')
    assert not accepts(bounded, '{"user": {"name": "a\x0b", "id": 7}, "ok": true}')
    assert not accepts(bounded, '{"user": {"name": "abcdefg", "id": 7}, "ok": true}')


def test_vllms_options_beside_the_kind():
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from sparrow.structured_output.grammar import _closed_objects

    schema = SCHEMAS["array"]
    # disable_any_whitespace: compact JSON even where the engine allows any whitespace.
    forced = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert not accepts(build_grammar(forced, any_whitespace=True), '{ "xs": [1, -2]}')
    assert accepts(build_grammar(forced, any_whitespace=True), '{"xs": [1, -2]}')
    assert grammar_key(forced) != grammar_key(StructuredOutputsParams(json=schema))  # compiled apart
    # disable_additional_properties: objects that do not say take false; a schema that says keeps it.
    objects = {"type": "object", "properties": {"a": {"type": "object"}, "b": {"type": "object",
                                                                                "additionalProperties": True}}}
    closed = _closed_objects(objects)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True
    grammar = build_grammar(StructuredOutputsParams(json=objects, disable_additional_properties=True))
    assert accepts(grammar, '{"a": {}, "b": {"x": 1}}') and not accepts(grammar, '{"a": {"x": 1}}')
    assert not accepts(grammar, '{"c": 1}')
    # disable_fallback holds (one backend); whitespace_pattern is refused, as are options of another kind.
    assert StructuredOutputsParams(regex="a+", disable_fallback=True).kind == "regex"
    for fields, field in ((dict(regex="a", whitespace_pattern=r"[ ]?"), "structured_outputs.whitespace_pattern"),
                          (dict(regex="a", disable_additional_properties=True),
                           "structured_outputs.disable_additional_properties"),
                          (dict(json=schema, disable_any_whitespace=1), "structured_outputs.disable_any_whitespace")):
        with pytest.raises(ValueError) as caught:
            StructuredOutputsParams(**fields)
        assert caught.value.field == field


# -- the scheduler's side (real scheduler, fake grammar and model output) -----------------------
class FakeGrammar:
    """The duck-typed interface the scheduler sees: ready when told, ends after ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.ready, self.length, self.accepted = False, length, []

    def is_ready(self) -> bool:
        return self.ready

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        self.accepted += token_ids
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def test_request_waiting_for_its_grammar_blocks_nobody_and_finishes_when_the_grammar_ends():
    engine, _ = make_engine()
    scheduler = engine.scheduler
    slow = Request("slow", list(range(1, 9)), SamplingParams(max_tokens=10, ignore_eos=True), max_tokens=10)
    slow.structured_output, slow.status = FakeGrammar(length=2), RequestStatus.WAITING_FOR_GRAMMAR
    scheduler.add_request(slow)
    plain = make_request("plain", 8)
    engine.add_request(plain)
    first = scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["plain"]
    assert scheduler.waiting[0] is slow and slow.status == RequestStatus.WAITING_FOR_GRAMMAR
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["plain"], sampled_token_ids=[[5]]))
    slow.structured_output.ready = True
    second = scheduler.schedule()
    assert set(second.num_scheduled_tokens) == {"plain", "slow"}
    scheduler.update_from_output(second, ModelRunnerOutput(req_ids=["plain", "slow"], sampled_token_ids=[[6], [7]]))
    third = scheduler.schedule()
    outputs = scheduler.update_from_output(third, ModelRunnerOutput(req_ids=["plain", "slow"],
                                                                    sampled_token_ids=[[8], [9]]))
    done = {out.request_id: out for out in outputs if out.finished}
    assert done["slow"].finish_reason.name == "STOP" and slow.structured_output.accepted == [7, 9]
    assert "plain" not in done  # max_tokens 4: still running


def test_bitmask_forbids_exactly_the_cleared_bits_of_listed_rows():
    logits = torch.randn(3, 70)
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    allowed[1, [5, 33]] = True
    words = torch.zeros(2, 3, dtype=torch.int64)
    for row in range(2):
        for token in allowed[row].nonzero().flatten().tolist():
            words[row, token // 32] |= 1 << (token % 32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign
    masked = apply_grammar_bitmask(logits, torch.tensor([2, 0]), words)
    assert torch.equal(masked[1], logits[1])  # not listed: untouched
    assert torch.equal(torch.isfinite(masked[2]), allowed[0]) and torch.equal(torch.isfinite(masked[0]), allowed[1])
    assert torch.equal(masked[2][allowed[0]], logits[2][allowed[0]])


# -- end to end -------------------------------------------------------------------------------
def test_every_constrained_output_is_valid_and_stops_under_preemption_and_chunking(llm):
    rng = random.Random(0)
    cases = [("json", schema) for schema in SCHEMAS.values()]
    cases += [("regex", REGEX), ("choice", CHOICES), ("grammar", GRAMMAR)]
    prompts, params, kinds = [], [], []
    for kind, spec in cases:
        for seed in (None, 11, 12, 13):  # greedy, then temperature 1.0
            prompts.append(prompt_of(rng, rng.randrange(5, 90)))
            params.append(constrained(seed, **{kind: spec}))
            kinds.append((kind, spec))
    # Unconstrained greedy neighbours must get exactly the tokens they get alone.
    free_prompts = [prompt_of(rng, 30) for _ in range(3)]
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [llm.generate(p, free, use_tqdm=False)[0].outputs[0].token_ids for p in free_prompts]
    outputs, num_preemptions = run(llm, prompts + free_prompts, params + [free] * 3)
    assert num_preemptions > 0  # the KV cache is too small for the batch
    for output, (kind, spec) in zip(outputs, kinds):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (kind, completion.text)
        check_valid(kind, spec, completion.text)
    assert [output.outputs[0].token_ids for output in outputs[len(prompts):]] == alone


def test_structural_tags_in_xgrammars_format_and_the_older_one_with_triggers(llm):
    """vLLM's structural_tag. xgrammar's format: a tag whose content follows a JSON schema is the
    whole output, and the request stops when it closes. The older form: free text until a
    trigger, then the tag; a bias towards the trigger's token makes the model open tags, and each
    one's content must follow the schema. Bad tags are ValueErrors naming the field."""
    schema = SCHEMAS["nested"]
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<user>", "end": "</user>",
                                                "content": {"type": "json_schema", "json_schema": schema}}}
    for seed in (None, 3):
        [output] = llm.generate([{"prompt": "Tell me about a user."}],
                                constrained(seed, structural_tag=json.dumps(tag)), use_tqdm=False)
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        match = re.fullmatch(r"<user>(.*)</user>", completion.text, re.S)
        assert match, completion.text
        jsonschema.validate(json.loads(match.group(1)), schema)
    [opening] = llm.get_tokenizer().encode("<", add_special_tokens=False)
    older = {"type": "structural_tag", "triggers": ["<"],
             "structures": [{"begin": "<tool>", "schema": SCHEMAS["enum"], "end": "</tool>"}]}
    params = SamplingParams(temperature=0.0, max_tokens=60, logit_bias={opening: 30.0},
                            structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(older)))
    text = llm.generate(["Call a tool."], params, use_tqdm=False)[0].outputs[0].text
    calls = re.findall(r"<tool>(.*?)</tool>", text, re.S)
    assert text.startswith("<tool>") and calls, text
    for call in calls:
        jsonschema.validate(json.loads(call), SCHEMAS["enum"])
    for bad, phrase in (({"type": "structural_tag", "format": {"type": "nope"}}, "not recognized"),
                        ({**older, "triggers": ["["]}, "begins none"),
                        ({**older, "extra": 1}, "'extra' is not a key"),
                        ({**older, "structures": [{"begin": "<a>", "schema": 3, "end": "</a>"}]}, "schema")):
        with pytest.raises(ValueError, match=f"structured_outputs.structural_tag is invalid: .*{phrase}"):
            check_structured_outputs(StructuredOutputsParams(structural_tag=json.dumps(bad)))
    with pytest.raises(ValueError, match="structural_tag must be a JSON object"):
        StructuredOutputsParams(structural_tag="[1]")


def test_n_logprobs_stop_strings_and_a_shared_cached_prompt(llm):
    prompt = prompt_of(random.Random(3), 40)
    schema = SCHEMAS["nested"]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=schema))
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]  # same prompt: served from the prefix cache
    assert again.num_cached_tokens > 0
    for output in (first, again):
        assert len(output.outputs) == 3
        for completion in output.outputs:  # each child has its own matcher
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), schema)
            assert len(completion.logprobs) == len(completion.token_ids)
            for token_id, position in zip(completion.token_ids, completion.logprobs):
                assert token_id in position and position[token_id].logprob <= 0.0
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    # A stop string inside the grammar's language ends the request there, with "stop".
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=["@"],
                                                  structured_outputs=StructuredOutputsParams(regex=REGEX)),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and re.fullmatch(r"[a-z]{1,8}", stopped.text), stopped.text


def test_invalid_grammar_fails_in_the_caller_and_the_engine_carries_on(llm):
    prompt = prompt_of(random.Random(4), 10)
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        llm.generate(prompt, SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
                     use_tqdm=False)
    out = llm.generate(prompt, constrained(None, choice=CHOICES), use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


def test_vllms_older_guided_decoding_is_structured_outputs_and_per_request_processors_are_refused(llm):
    from sparrow.sampling_params import GuidedDecodingParams

    prompt = prompt_of(random.Random(5), 12)
    with pytest.warns(DeprecationWarning, match="guided_decoding is vLLM's older name"):
        older = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                               guided_decoding=GuidedDecodingParams(regex=REGEX))
    assert older.structured_outputs == StructuredOutputsParams(regex=REGEX) and older.guided_decoding is None
    got, expected = (llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
                     for params in (older, constrained(3, regex=REGEX)))
    assert re.fullmatch(REGEX, got.text) and got.token_ids == expected.token_ids
    with pytest.raises(ValueError, match="guided_decoding is vLLM's older name of structured_outputs; give one"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"),
                       structured_outputs=StructuredOutputsParams(regex="b"))
    with pytest.raises(ValueError, match="SamplingParams.guided_decoding must be a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"regex": "a"})
    with pytest.raises(ValueError, match="logits_processors is not supported per request.*extra_args"):
        SamplingParams(logits_processors=[lambda token_ids, logits: logits])


def core_request(req_id: str, max_tokens: int = 4, **kind):
    from sparrow.engine.messages import EngineCoreRequest

    grammar = StructuredOutputsParams(**kind) if kind else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=grammar)
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=[5, 6, 7], sampling_params=params,
                             max_tokens=max_tokens)


def run_to_the_end(engine, timeout: float = 120.0) -> dict:
    """Step ``engine`` until nothing is left (grammars compile in a child process that takes a
    few seconds to start); the finished outputs by request id."""
    finished = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"still unfinished after {timeout} s"
        for output in engine.step().outputs:
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_a_grammar_that_fails_to_compile_in_the_engine_core_fails_only_its_request(qwen3_dir):
    # A client that skips the frontend's parse (EngineCoreRequest built by hand): the core's
    # compile fails, that request ends with an error output, the other one runs.
    engine, _ = make_engine(model=qwen3_dir, tokenizer=qwen3_dir, max_model_len=256)
    engine.add_request(core_request("bad", regex="(unclosed"))
    engine.add_request(core_request("good", choice=["yes", "no"]))
    finished = run_to_the_end(engine)
    assert "structured_outputs.regex is invalid" in (finished["bad"].error_message or "")
    assert finished["good"].error_message is None
    engine.shutdown()


# "(a|b)*" written n times: xgrammar's compile time grows faster than n (about 0.2 s at n=100, 4 s
# at 400, two minutes at 2,000 on a 2-core VM), and so does each token mask's (18 ms at n=100,
# against well under 1 ms for the grammars above).
def slow_regex(n: int) -> str:
    return "(a|b)*" * n


def test_a_grammar_past_the_compile_timeout_fails_alone_and_its_compile_is_killed(qwen3_dir):
    engine, _ = make_engine(model=qwen3_dir, tokenizer=qwen3_dir, max_model_len=256,
                            structured_outputs_compile_timeout=3.0)
    manager = engine.structured_output_manager()
    # Started first, so that the child process is up and the timeout measures the compile alone.
    engine.add_request(core_request("warm", choice=["yes", "no"]))
    assert run_to_the_end(engine)["warm"].error_message is None
    [first_child] = manager.worker_pids()

    started = time.monotonic()
    engine.add_request(core_request("slow", regex=slow_regex(2000)))
    engine.add_request(core_request("plain", max_tokens=6))
    finished = run_to_the_end(engine)
    assert time.monotonic() - started < 60  # not the two minutes the compile would take
    assert "did not compile within 3 s (structured_outputs_compile_timeout)" in finished["slow"].error_message
    assert finished["plain"].error_message is None and len(finished["plain"].new_token_ids) >= 1

    # The slow compile's process is gone, not left burning a core.
    deadline = time.monotonic() + 10
    while first_child in manager.worker_pids() or _pid_alive(first_child):
        assert time.monotonic() < deadline, "the timed-out compile process is still running"
        time.sleep(0.1)
    # The same grammar again fails at once (the failure is cached), and other grammars compile
    # in a new process.
    engine.add_request(core_request("slow-again", regex=slow_regex(2000)))
    engine.add_request(core_request("after", choice=["yes", "no"]))
    started = time.monotonic()
    finished = run_to_the_end(engine)
    assert "did not compile within" in finished["slow-again"].error_message
    assert finished["after"].error_message is None
    engine.shutdown()
    assert manager.worker_pids() == []


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by us) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_grammars_whose_token_masks_cost_too_much_fail_alone(qwen3_dir):
    # Budget 2 ms: the test's fast grammars take well under 1 ms per mask, slow_regex(100) ~18 ms.
    # A real model in-process: the grammar must steer the tokens past "x".
    from sparrow.config import EngineConfig
    from sparrow.engine.core import EngineCore

    engine = EngineCore(EngineConfig.from_kwargs(model=qwen3_dir, tokenizer=qwen3_dir, max_model_len=256,
                                                 dtype="float32", structured_outputs_mask_budget_ms=2.0))
    # Expensive from its first token: refused when it compiles.
    engine.add_request(core_request("expensive", regex=slow_regex(100)))
    # Cheap at its first tokens, then 20-400 ms per mask for at least the eight characters it
    # asks for (xgrammar turns some simpler tails into cheap automata): failed by the step loop.
    engine.add_request(core_request("later", max_tokens=12, regex="x(ab" + slow_regex(100) + "){4}"))
    engine.add_request(core_request("cheap", max_tokens=12, regex=r"[a-z]{1,8}@(foo|bar)\.(com|org)"))
    finished = run_to_the_end(engine)
    assert "first token mask took" in finished["expensive"].error_message
    assert "structured_outputs_mask_budget_ms" in finished["expensive"].error_message
    later = finished["later"]
    assert "on 3 steps, over the budget of 2 ms" in later.error_message, later
    assert finished["cheap"].error_message is None
    engine.shutdown()


def test_bitmask_kernel_and_tensor_ops_agree():
    # The CPU path (xgrammar's kernel) against the device-agnostic one (run here on the "meta"-free
    # CPU by calling it with float64 logits, which the kernel path does not take).
    logits = torch.randn(5, 100)
    words = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32)  # 96 tokens: the last 4 are past it
    rows = torch.tensor([4, 1, 2])
    fast = apply_grammar_bitmask(logits, rows, words)
    portable = apply_grammar_bitmask(logits.double(), rows, words).float()
    assert torch.equal(fast, portable) and torch.isinf(fast[rows, 96:]).all()
