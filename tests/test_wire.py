"""sparrow.wire: every cross-process message in one leaf module, and the typed invalid-argument
error that crosses with them.

Import structure is checked by parsing the source (ast), so a lazy import inside a function or a
TYPE_CHECKING block counts as much as one at the top."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import msgspec
import pytest

import sparrow
from sparrow import wire
from sparrow.errors import InvalidArgumentError

FRAMEWORK = Path(sparrow.__file__).parent
# Modules wire may import: the user-facing SamplingParams and LoRARequest (Structs that travel
# inside requests) and the errors SamplingParams raises.
LEAF_MODULES = {"sparrow.sampling_params", "sparrow.sampling_options", "sparrow.param_checks", "sparrow.errors",
                "sparrow.lora.request", "sparrow.pooling_params"}


def sparrow_imports(path: Path) -> set[str]:
    """Every sparrow module ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "sparrow" or name.startswith("sparrow.")}


def module_path(name: str) -> Path:
    relative = Path(*name.split(".")[1:])
    package = FRAMEWORK / relative / "__init__.py"
    return package if package.exists() else FRAMEWORK / relative.with_suffix(".py")


def test_core_and_sample_import_no_engine_or_worker_module():
    files = sorted((FRAMEWORK / "core").rglob("*.py")) + sorted((FRAMEWORK / "sample").rglob("*.py"))
    assert len(files) > 10
    offenders = {
        str(path.relative_to(FRAMEWORK)): sorted(name for name in sparrow_imports(path)
                                                 if name.startswith(("sparrow.engine", "sparrow.worker")))
        for path in files
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_wire_is_a_leaf_module():
    imported = {name for name in sparrow_imports(module_path("sparrow.wire"))}
    # "from sparrow.sampling_params import SamplingParams" also yields the dotted name of the object.
    modules = {name for name in imported if module_path(name).exists()}
    assert modules <= LEAF_MODULES, modules
    for leaf in LEAF_MODULES:
        others = {name for name in sparrow_imports(module_path(leaf)) if module_path(name).exists()}
        assert others <= LEAF_MODULES, (leaf, others)


def structs_reachable(root: type) -> set[type]:
    """Every msgspec Struct type a decoder of ``root`` decodes, nested ones included."""
    found: set[type] = set()

    def walk(info: msgspec.inspect.Type) -> None:
        if isinstance(info, msgspec.inspect.StructType):
            if info.cls in found:
                return
            found.add(info.cls)
            for field in info.fields:
                walk(field.type)
            return
        for name in ("item_type", "key_type", "value_type"):
            if hasattr(info, name):
                walk(getattr(info, name))
        for child in getattr(info, "types", ()) or ():
            walk(child)
        for child in getattr(info, "item_types", ()) or ():
            walk(child)

    walk(msgspec.inspect.type_info(root))
    return found


def test_every_struct_that_crosses_a_process_lives_in_wire():
    from sparrow.engine import serial
    from sparrow.lora.request import LoRARequest
    from sparrow.pooling_params import PoolingParams
    from sparrow.sampling_params import (
        RepetitionDetectionParams,
        SamplingParams,
        StructuredOutputsParams,
        ThinkingMarkers,
    )

    decoded = [serial.request_decoder().type, serial.outputs_decoder().type, serial.handshake_decoder().type,
               # worker boundary (sparrow.executor.multiproc) and the typed utility result
               wire.SchedulerOutput, wire.ModelRunnerOutput, wire.SchedulerStats]
    structs = set().union(*(structs_reachable(root) for root in decoded))
    assert {wire.EngineCoreRequest, wire.EngineCoreOutput, wire.TokenLogprobs, wire.NewRequestData,
            wire.HandshakeMessage, wire.SchedulerStats} <= structs
    elsewhere = {cls for cls in structs if cls.__module__ != "sparrow.wire"}
    # The user-facing sampling and pooling parameters and adapter requests travel inside requests
    # from their own leaf modules.
    assert elsewhere == {SamplingParams, StructuredOutputsParams, RepetitionDetectionParams, ThinkingMarkers,
                         LoRARequest, PoolingParams}
    for cls in structs - elsewhere:
        config = cls.__struct_config__
        assert config.array_like and config.omit_defaults or cls is wire.TokenLogprobs, cls


def test_old_homes_re_export_the_same_classes():
    from sparrow.core.request import FinishReason
    from sparrow.core.sched import output
    from sparrow.engine import messages, serial
    from sparrow.worker import outputs

    assert messages.EngineCoreRequest is wire.EngineCoreRequest
    assert messages.EngineCoreOutputs is wire.EngineCoreOutputs
    assert messages.SchedulerStats is wire.SchedulerStats
    assert output.SchedulerOutput is wire.SchedulerOutput
    assert outputs.ModelRunnerOutput is wire.ModelRunnerOutput and outputs.TokenLogprobs is wire.TokenLogprobs
    assert serial.HandshakeMessage is wire.HandshakeMessage and FinishReason is wire.FinishReason


def test_an_error_finish_round_trips_with_its_field():
    from sparrow.engine import serial

    message = wire.EngineCoreOutputs(outputs=[wire.EngineCoreOutput(
        request_id="r", new_token_ids=[], finish_reason=wire.FinishReason.ABORT,
        error_message="too long", error_field="max_tokens")])
    decoded = serial.outputs_decoder().decode(serial.make_encoder().encode(message))
    assert decoded == message and decoded.outputs[0].error_field == "max_tokens"
    stats = wire.SchedulerStats(num_preemptions=3, prefix_cache_hits=5)
    assert serial.decode_result(msgspec.msgpack.decode(msgspec.msgpack.encode(serial.encode_result(stats)))) == stats


def test_invalid_argument_error_pickles_with_its_field():
    from sparrow.entrypoints.openai.request_checks import RequestFieldError

    for error in (InvalidArgumentError("max_tokens must be >= 1", "max_tokens"),
                  InvalidArgumentError("bad", "messages[2].content", code="unsupported"),
                  RequestFieldError("tool_choice: needs tools", "tool_choice")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and isinstance(copy, ValueError)
        assert (str(copy), copy.field, copy.code) == (str(error), error.field, error.code)
    assert copy.param == "tool_choice"


def test_sampling_params_and_input_processing_name_the_field():
    from sparrow.engine.input_processor import InputProcessor
    from sparrow.sampling_params import SamplingParams

    cases = [(dict(max_tokens=0), "max_tokens"), (dict(top_p=2.0), "top_p"), (dict(stop=["ok", ""]), "stop[1]"),
             (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={3: 500.0}), "logit_bias[3]"),
             (dict(extra_args={"a": object()}), "extra_args"), (dict(min_tokens=5, max_tokens=2), "min_tokens")]
    for kwargs, field in cases:
        with pytest.raises(InvalidArgumentError) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field, (kwargs, info.value)
    processor = InputProcessor(None, max_model_len=32, vocab_size=100)
    for prompt, params, field in [
        ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=31), "max_tokens"),
        ({"prompt_token_ids": [1, 200]}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1, "2"]}, SamplingParams(), "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=[100]), "stop_token_ids"),
        ({"prompt_token_ids": [1]}, SamplingParams(logprobs=21), "logprobs"),
        ("text without a tokenizer", SamplingParams(), "prompt"),
    ]:
        with pytest.raises(InvalidArgumentError) as info:
            processor.process_inputs("r", prompt, params)
        assert info.value.field == field, (prompt, info.value)


def test_the_server_takes_param_from_the_field_not_the_message():
    from sparrow.entrypoints.openai.serving_engine import bad_request

    error = bad_request(InvalidArgumentError("temperature looks odd (this text names another field)", "stop[2]"))
    assert (error.status_code, error.param, error.code) == (400, "stop", "invalid_value")
    error = bad_request(InvalidArgumentError("x", "messages[1].content[0].text", code="unsupported"))
    assert (error.param, error.code) == ("messages[1].content", "unsupported")
    assert bad_request(InvalidArgumentError("x", "extra_args")).param == "vllm_xargs"
    assert bad_request(InvalidArgumentError("x", "prompt_token_ids[3]")).param == "prompt"
    # A plain ValueError (a plugin's logits processor, say) still gets its leading field name.
    assert bad_request(ValueError("min_p must be small")).param == "min_p"
    assert bad_request(ValueError("something else"), default_param="prompt").param == "prompt"


def test_an_engine_core_refusal_crosses_the_process_with_its_field():
    """The engine core, in its own process (with the fake model), refuses requests its KV cache
    (1024 tokens) can never hold: the error finish carries the field, which the frontends raise
    as an InvalidArgumentError; the other requests carry on."""
    from sparrow.config import EngineConfig
    from sparrow.engine.mp_client import SyncMPClient
    from sparrow.errors import error_from_engine
    from sparrow.sampling_params import SamplingParams

    def request(request_id: str, prompt_len: int, max_tokens: int) -> wire.EngineCoreRequest:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return wire.EngineCoreRequest(request_id=request_id, prompt_token_ids=[1 + i % 900 for i in range(prompt_len)],
                                      sampling_params=params, max_tokens=max_tokens)

    config = EngineConfig.from_kwargs(max_model_len=4096)
    client = SyncMPClient(config, executor_factory="tests.fake_executor:FakeExecutor")
    try:
        for sent in (request("long-output", 1000, 100), request("long-prompt", 2000, 1), request("fine", 10, 3)):
            client.add_request(sent)
        refused, finished = {}, set()
        while len(refused) + len(finished) < 3:
            for output in client.get_output().outputs:
                if output.error_message is not None:
                    refused[output.request_id] = error_from_engine(output.error_message, output.error_field)
                elif output.finished:
                    finished.add(output.request_id)
    finally:
        client.shutdown()
    assert finished == {"fine"}
    assert {request_id: type(error) for request_id, error in refused.items()} == {
        "long-output": InvalidArgumentError, "long-prompt": InvalidArgumentError}
    assert refused["long-output"].field == "max_tokens" and "1024 tokens" in str(refused["long-output"])
    assert refused["long-prompt"].field == "prompt"
    assert type(error_from_engine("a grammar failed to compile", None)) is ValueError


def test_llm_refuses_what_the_kv_cache_cannot_hold_naming_the_field(qwen3_dir):
    from sparrow import LLM, SamplingParams

    # 4 blocks of 16 tokens: a 20-token prompt fits, 20 + 100 output tokens do not.
    llm = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=256, num_kv_blocks=4, block_size=16)
    try:
        with pytest.raises(InvalidArgumentError, match="needs KV cache for 120 tokens") as info:
            llm.generate({"prompt_token_ids": list(range(1, 21))}, SamplingParams(max_tokens=100), use_tqdm=False)
        assert info.value.field == "max_tokens"
        with pytest.raises(InvalidArgumentError) as info:
            llm.generate({"prompt_token_ids": list(range(1, 101))}, SamplingParams(max_tokens=1), use_tqdm=False)
        assert info.value.field == "prompt"
        fine = llm.generate({"prompt_token_ids": list(range(1, 21))}, SamplingParams(max_tokens=3, ignore_eos=True),
                            use_tqdm=False)
        assert len(fine[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
