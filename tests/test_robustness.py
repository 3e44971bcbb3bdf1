"""Bad input cannot wedge anything: wrong SamplingParams, requests that fail in the engine core's
input path, batches that fail half-way through submission, and impossible configurations.

Every test meets the engine where a user does (a real ``LLM`` on the tiny Qwen3 test model, its
engine core in its own process) and checks three things: the error is a ValueError/ConfigError
naming the field, the engine is still usable, and the next request's output equals a fresh run's.
"""

from __future__ import annotations

import _posixsubprocess
import os
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError
from sparrow.engine.messages import EngineCoreRequest, EngineCoreRequestType
from sparrow.hookspecs import hookimpl
from sparrow.plugins import get_plugin_manager

PROMPTS = ["The quick brown fox", "Once upon a time", "Sparrow is an engine that", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_kv_blocks=128)


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def llm_and_baseline(qwen3_dir):
    """An LLM with its engine core in its own process, and its greedy outputs of PROMPTS while
    nothing had gone wrong yet (a fresh run's)."""
    llm = LLM(qwen3_dir, **ENGINE_ARGS)
    baseline = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    yield llm, baseline
    llm.shutdown()


def assert_still_right(llm: LLM, baseline: list[list[int]]) -> None:
    """Nothing is left registered, and two calls in a row give a fresh run's outputs."""
    assert not llm.llm_engine.has_unfinished_requests()
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    assert token_ids(llm.generate(PROMPTS[::-1], GREEDY, use_tqdm=False)) == baseline[::-1]


# -- SamplingParams checks types in the caller ----------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 4.0), ("max_tokens", "4"), ("max_tokens", True), ("top_k", 3.5), ("n", 2.0),
    ("min_tokens", np.float64(1.0)), ("logprobs", "2"), ("prompt_logprobs", 1.5), ("seed", 2**70),
    ("seed", 1.0), ("top_k", 2**64), ("temperature", "0.5"), ("temperature", float("nan")),
    ("top_p", float("inf")), ("presence_penalty", None), ("repetition_penalty", True),
    ("ignore_eos", "no"), ("detokenize", 1), ("output_kind", 9),
])
def test_sampling_params_reject_wrong_types_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value, shown", [
    ("stop_token_ids", [1, 2.0], r"stop_token_ids\[1\]"), ("stop_token_ids", [True], r"stop_token_ids\[0\]"),
    ("allowed_token_ids", ["3"], r"allowed_token_ids\[0\]"), ("logit_bias", {1.0: 2.0}, "logit_bias key"),
    ("logit_bias", {1: "x"}, r"logit_bias\[1\]"), ("stop", ["ok", 3], r"stop\[1\]"), ("stop", 7, "stop"),
])
def test_sampling_params_check_every_item_of_a_list(field, value, shown):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{shown}"):
        SamplingParams(**{field: value})


def test_numpy_numbers_are_accepted_as_plain_python_numbers():
    params = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), top_k=np.uint8(3), seed=np.int64(7),
                            temperature=np.float32(0.5), stop_token_ids=np.array([4, 5]),
                            logit_bias={np.int64(9): np.float64(1.5)}, ignore_eos=np.bool_(True))
    assert (params.n, params.max_tokens, params.top_k, params.seed) == (2, 5, 3, 7)
    assert params.stop_token_ids == [4, 5] and params.logit_bias == {9: 1.5} and params.ignore_eos is True
    for value in (params.n, params.max_tokens, params.top_k, params.seed, *params.stop_token_ids):
        assert type(value) is int
    assert type(params.temperature) is float and params.temperature == 0.5
    # Exactly what the engine core will decode.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


def test_seeds_are_64_bit_integers():
    for seed in (-(2**63), 0, 2**63 - 1):
        params = SamplingParams(seed=seed)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams).seed == seed
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError, match=r"SamplingParams\.seed must be an integer in"):
            SamplingParams(seed=seed)


# -- LLM.generate: whole batches, nothing half-registered -----------------------------------------
def test_wrong_params_fail_in_the_caller_and_the_llm_stays_right(llm_and_baseline):
    llm, baseline = llm_and_baseline
    for field, value in (("max_tokens", 4.0), ("top_k", 3.5), ("seed", 2**70), ("ignore_eos", "yes")):
        # Set after construction, so the value skipped SamplingParams' own checks; generate checks
        # again before anything is submitted.
        params = SamplingParams(temperature=0.7, max_tokens=4)
        setattr(params, field, value)
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
            llm.generate(PROMPTS, [GREEDY, GREEDY, params, GREEDY], use_tqdm=False)
    for priority in (2**70, 1.5, "high"):
        with pytest.raises(ValueError, match=r"priority\[1\]"):
            llm.generate(PROMPTS[:2], GREEDY, priority=[0, priority], use_tqdm=False)
    assert_still_right(llm, baseline)


def test_a_batch_that_fails_half_way_through_submission_leaves_nothing_behind(llm_and_baseline):
    llm, baseline = llm_and_baseline
    client = llm.llm_engine.engine_core
    send = client.add_request
    sent = []

    def fail_third(request):  # the transport failing on the third request of the batch
        if len(sent) == 2:
            raise OSError("the socket broke")
        sent.append(request.request_id)
        send(request)

    client.add_request = fail_third
    try:
        with pytest.raises(OSError, match="socket broke"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        del client.add_request
    assert len(sent) == 2  # two requests reached the engine core, and were aborted there
    assert_still_right(llm, baseline)


# -- the engine core fails only the offending request ---------------------------------------------
def send_raw(client, request_type: EngineCoreRequestType, payload: bytes) -> None:
    """A hand-made message on the client's real input socket (as a buggy or hostile client would).
    The client has no public way to send bytes it did not encode, so this reaches for its sender."""
    engine_process = getattr(client, "_engine", client)
    send = getattr(engine_process, "send", None) or engine_process._send
    send(request_type, payload)


def test_requests_that_fail_in_the_engine_core_input_path_fail_alone(llm_and_baseline):
    llm, baseline = llm_and_baseline
    engine = llm.llm_engine
    vocab_size = engine.hf_config.vocab_size

    for index, prompt in enumerate(PROMPTS):  # the good ones, in flight throughout
        engine.add_request(f"good-{index}", prompt, GREEDY)

    # Each of these passed the frontend's checks and was spoiled afterwards, as a buggy client's.
    text, out_of_vocab = engine.process_request("bad-token", PROMPTS[0], GREEDY)
    out_of_vocab.prompt_token_ids = [1, vocab_size + 7]  # would index past the embedding
    engine.add_processed_request(text, out_of_vocab)
    text, float_tokens = engine.process_request("bad-type", PROMPTS[1], GREEDY)
    float_tokens.sampling_params.max_tokens = 4.0  # msgspec refuses it when the core decodes it
    engine.add_processed_request(text, float_tokens)
    text, nan_params = engine.process_request("bad-value", PROMPTS[2], GREEDY)
    nan_params.sampling_params.temperature = float("nan")
    engine.add_processed_request(text, nan_params)
    # Raw payloads: an unknown extra field, and garbage after a readable request id.
    text, extra = engine.process_request("bad-field", PROMPTS[3], GREEDY)
    engine.output_processor.add_request(extra, text)
    send_raw(engine.engine_core, EngineCoreRequestType.ADD,
             msgspec.msgpack.encode([*msgspec.to_builtins(extra), "surprise"]))
    text, garbled = engine.process_request("bad-bytes", PROMPTS[3], GREEDY)
    engine.output_processor.add_request(garbled, text)
    send_raw(engine.engine_core, EngineCoreRequestType.ADD, msgspec.msgpack.encode(["bad-bytes", "not tokens", {}]))
    # Nothing to answer: logged and dropped, never fatal.
    send_raw(engine.engine_core, EngineCoreRequestType.ADD, b"\xc1\xff\x00")
    send_raw(engine.engine_core, EngineCoreRequestType.ABORT, msgspec.msgpack.encode({"not": "a list"}))
    send_raw(engine.engine_core, EngineCoreRequestType.UTILITY, msgspec.msgpack.encode("no call id"))
    send_raw(engine.engine_core, EngineCoreRequestType.UTILITY, msgspec.msgpack.encode([10**6, 5, "args"]))

    errors: dict[str, str] = {}
    finished = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except ValueError as exc:
            for request_id in ("bad-token", "bad-type", "bad-value", "bad-field", "bad-bytes"):
                if f"request {request_id!r}" in str(exc):
                    errors[request_id] = str(exc)
            continue
        finished.update({o.request_id: list(o.outputs[0].token_ids) for o in outputs if o.finished})

    assert set(errors) == {"bad-token", "bad-type", "bad-value", "bad-field", "bad-bytes"}
    assert "prompt_token_ids[1]" in errors["bad-token"] and str(vocab_size) in errors["bad-token"]
    assert "sampling_params.max_tokens" in errors["bad-type"]
    assert "temperature" in errors["bad-value"]
    num_fields = len(EngineCoreRequest.__struct_fields__)
    assert f"at most length {num_fields}, got {num_fields + 1}" in errors["bad-field"]
    assert "prompt_token_ids" in errors["bad-bytes"]
    assert finished == {f"good-{index}": tokens for index, tokens in enumerate(baseline)}
    # The engine core is alive and answers utilities; the next requests are right.
    assert engine.engine_core.call_utility("get_kv_cache_info")["num_blocks"] == 128
    assert_still_right(llm, baseline)


class FaultyAddScheduler:
    """A scheduler plugin whose add_request breaks half-way (after registering the request) for
    prompts that start with BOOM_TOKEN."""

    BOOM_TOKEN = 4001

    @hookimpl
    def sparrow_register_schedulers(self, register):
        from sparrow_schedulers import FCFSScheduler

        boom = self.BOOM_TOKEN

        class Faulty(FCFSScheduler):
            def add_request(self, request):
                super().add_request(request)
                if request.prompt_token_ids[0] == boom:
                    raise RuntimeError("the scheduler tripped over this request")

        register("faulty-add", Faulty)


def test_a_request_that_breaks_the_schedulers_add_fails_alone(qwen3_dir, llm_and_baseline):
    _, baseline = llm_and_baseline
    pm = get_plugin_manager()
    pm.register(FaultyAddScheduler(), name="faulty-add-plugin")
    # Chunked prefill off, with the smallest budget pre-flight accepts.
    llm = None
    try:
        llm = LLM(qwen3_dir, multiprocess=False, scheduler="faulty-add", enable_chunked_prefill=False,
                  max_num_batched_tokens=ENGINE_ARGS["max_model_len"], **ENGINE_ARGS)
        engine = llm.llm_engine
        for index, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(f"good-{index}", prompt, GREEDY)
        engine.step()  # the good ones are running when the bad one arrives
        with pytest.raises(RuntimeError, match="tripped"):
            engine.add_request("boom", {"prompt_token_ids": [FaultyAddScheduler.BOOM_TOKEN, 5, 6]}, GREEDY)
        scheduler = engine.engine_core.engine_core.scheduler
        assert "boom" not in scheduler.requests and len(scheduler.waiting) + len(scheduler.running) == 2
        for index, prompt in enumerate(PROMPTS[2:], start=2):
            engine.add_request(f"good-{index}", prompt, GREEDY)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
        assert finished == {f"good-{index}": tokens for index, tokens in enumerate(baseline)}
        # Through LLM.generate: the batch fails as a whole, and the next one is right.
        with pytest.raises(RuntimeError, match="tripped"):
            llm.generate([PROMPTS[0], {"prompt_token_ids": [FaultyAddScheduler.BOOM_TOKEN, 7]}], GREEDY,
                         use_tqdm=False)
        assert_still_right(llm, baseline)
    finally:
        if llm is not None:
            llm.shutdown()
        pm.unregister(name="faulty-add-plugin")


# -- configuration errors, in the caller, before any process --------------------------------------
def child_pids() -> set[int]:
    me = str(os.getpid())
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # fields: state, ppid, ...
            children.add(int(stat.parent.name))
    return children


@pytest.fixture
def no_process_may_start(monkeypatch):
    """Any attempt to start a process (fork, spawn, subprocess) fails the test."""
    attempts: list[str] = []

    def refuse(name):
        def start(*args, **kwargs):
            attempts.append(name)
            raise AssertionError(f"a process was started ({name}) before the configuration was checked")
        return start

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse("fork_exec"))
    monkeypatch.setattr(os, "fork", refuse("fork"))
    monkeypatch.setattr(os, "posix_spawn", refuse("posix_spawn"))
    monkeypatch.setattr(os, "posix_spawnp", refuse("posix_spawnp"))
    before = child_pids()
    yield
    assert not attempts
    assert child_pids() <= before


@pytest.fixture(scope="module")
def broken_model_dirs(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("broken-models")
    dirs = {}
    for name, remove in (("no-weights", "*.safetensors"), ("no-tokenizer", "tokenizer*"),
                         ("no-config", "config.json")):
        target = root / name
        shutil.copytree(qwen3_dir, target)
        for path in target.glob(remove):
            path.unlink()
        dirs[name] = str(target)
    (root / "a-file").write_text("not a directory")
    dirs["a-file"] = str(root / "a-file")
    dirs["missing"] = str(root / "missing")
    return dirs


@pytest.mark.parametrize("kwargs, field, detail", [
    (dict(scheduler="fifo"), "scheduler", "unknown scheduler 'fifo'; registered: .*fcfs"),
    (dict(device="tpu"), "device", "unknown device 'tpu'; installed platforms: .*cpu"),
    (dict(device="cpu", attention_backend="flash"), "attention_backend", "'flash' is not available on cpu"),
    (dict(device="cpu", dtype="float16"), "dtype", "not supported on platform 'cpu'"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128),
     "max_num_batched_tokens", "smaller than max_model_len=128"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size", "does not divide the model's 4 attention heads"),
    (dict(kv_connector="carrier-pigeon", kv_role="kv_both"), "kv_connector", "unknown kv_connector"),
    (dict(kv_connector="shared_storage"), "kv_role", "must be set"),
])
def test_configuration_errors_are_raised_before_any_process(qwen3_dir, no_process_may_start, kwargs, field, detail):
    with pytest.raises(ConfigError, match=rf"invalid engine argument '{field}': .*{detail}"):
        LLM(qwen3_dir, **kwargs)


@pytest.mark.parametrize("broken, field, detail", [
    ("missing", "model", "does not exist"),
    ("a-file", "model", "is not a directory"),
    ("no-config", "model", "has no config.json"),
    ("no-weights", "model", r"no \*\.safetensors weight files"),
    ("no-tokenizer", "tokenizer", "holds no tokenizer files"),
])
def test_model_directory_errors_are_raised_before_any_process(broken_model_dirs, no_process_may_start,
                                                                broken, field, detail):
    with pytest.raises(ConfigError, match=rf"invalid engine argument '{field}': .*{detail}"):
        LLM(broken_model_dirs[broken])
