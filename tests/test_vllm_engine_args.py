"""vLLM engine arguments a user switching over passes as they are: the values Sparrow runs are
accepted and change nothing; the others are refused naming the argument (real tiny model)."""

from __future__ import annotations

import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError, EngineConfig

ENGINE = dict(multiprocess=False, max_model_len=128)
GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPTS = ["the quick brown fox", "once upon a time"]


def token_ids(llm: LLM) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_vllm_values_sparrow_runs_are_accepted_and_change_nothing(qwen3_dir):
    plain = LLM(qwen3_dir, **ENGINE)
    try:
        expected = token_ids(plain)
    finally:
        plain.shutdown()
    switched = LLM(qwen3_dir, pipeline_parallel_size=1, runner="generate", task="generate",
                   disable_custom_all_reduce=True, **ENGINE)
    try:
        assert token_ids(switched) == expected
    finally:
        switched.shutdown()


@pytest.mark.parametrize(("name", "value", "words"), [
    ("pipeline_parallel_size", 2, "pipeline parallelism is not implemented"),
    ("runner", "classify", "must be one of auto, generate, pooling"),
    ("task", "reward", "must be one of auto, generate, embed, classify, score"),
    ("convert", "reward", "must be one of auto, none, embed, classify"),
    ("scheduling_policy", "sjf", "'fcfs' or 'priority'"),
])
def test_values_sparrow_does_not_run_are_refused_by_name(name, value, words):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(**{name: value})
    assert f"invalid engine argument {name!r}" in str(info.value) and words in str(info.value)


def test_serve_takes_them_as_flags():
    from sparrow.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "m", "--pipeline-parallel-size", "1", "--runner", "generate",
                                      "--disable-custom-all-reduce", "--scheduling-policy", "priority"])
    kwargs = engine_kwargs(args)
    assert kwargs["pipeline_parallel_size"] == 1 and kwargs["runner"] == "generate"
    assert kwargs["disable_custom_all_reduce"] is True and kwargs["scheduling_policy"] == "priority"


def test_kv_transfer_config_is_vllms_dict_of_the_connector_settings(qwen3_dir, tmp_path):
    """A disaggregated-prefill pair started as vLLM's examples start it: the producer from the
    command line's --kv-transfer-config JSON, the consumer with a KVTransferConfig object; the
    consumer loads the producer's blocks and generates what an engine alone does."""
    import json

    from sparrow.config import KVTransferConfig
    from sparrow.entrypoints.cli import build_parser, engine_kwargs
    from tests.test_kv_connector import prompts_for, run

    prompts = prompts_for(4096)
    expected = run(qwen3_dir, prompts, 4, enable_prefix_caching=False)
    storage = {"storage_path": str(tmp_path / "kv")}
    flag = json.dumps({"kv_connector": "shared_storage", "kv_role": "kv_producer",
                       "kv_connector_extra_config": storage})
    producer = engine_kwargs(build_parser().parse_args(["serve", "m", "--kv-transfer-config", flag]))
    config = EngineConfig.from_kwargs(**producer)
    assert (config.kv_transfer.kv_connector, config.kv_transfer.kv_role) == ("shared_storage", "kv_producer")
    run(qwen3_dir, prompts, 1, kv_transfer_config=producer["kv_transfer_config"])
    assert list((tmp_path / "kv").glob("*.safetensors"))
    consumer = KVTransferConfig(kv_connector="shared_storage", kv_role="kv_consumer",
                                kv_connector_extra_config=storage)
    assert run(qwen3_dir, prompts, 4, enable_prefix_caching=False, kv_transfer_config=consumer) == expected
    for kwargs, words in [({"kv_transfer_config": {"kv_connector": "shared_storage", "kv_buffer_device": "cuda"}},
                           "kv_transfer_config.kv_buffer_device is not supported"),
                          ({"kv_transfer_config": {"kv_role": "kv_both"}, "kv_role": "kv_both"},
                           "kv_transfer_config.kv_role and kv_role are both given"),
                          ({"kv_transfer_config": "shared_storage"}, "must be a dict")]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig.from_kwargs(**kwargs)


def test_structured_outputs_config_is_vllms_dict_of_the_structured_output_settings():
    from sparrow.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "m", "--structured-outputs-config.backend", "xgrammar",
                                      "--structured-outputs-config.disable_any_whitespace", "false",
                                      "--structured-outputs-config.reasoning_parser", "qwen3"])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.model.structured_outputs_any_whitespace is True and config.model.reasoning_parser == "qwen3"
    # vLLM's defaults, as a full dump of its config has them: Sparrow runs each of them.
    defaults = {"backend": "auto", "disable_fallback": False, "disable_any_whitespace": False,
                "disable_additional_properties": False, "reasoning_parser": "", "enable_in_reasoning": False}
    assert EngineConfig.from_kwargs(structured_outputs_config=defaults).model.reasoning_parser is None
    assert EngineConfig.from_kwargs(structured_outputs_config={"disable_any_whitespace": True}
                                    ).model.structured_outputs_any_whitespace is False
    for value, words in [({"backend": "guidance"}, "run on xgrammar"),
                         ({"enable_in_reasoning": True}, "after the reasoning ends"),
                         ({"disable_fallback": "yes"}, "must be true or false"),
                         ({"whitespace_pattern": " "}, "not one of vLLM's keys")]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig.from_kwargs(structured_outputs_config=value)


def test_vllm_flags_sparrow_does_not_take_are_refused_with_the_reason():
    """`sparrow serve --swap-space 4` is argparse's "unrecognized arguments" with the reason for each
    vLLM flag Sparrow does not take, engine arguments and serve flags alike; other unknown flags
    are still named as such."""
    import subprocess
    import sys

    from sparrow.config import VLLM_ARGUMENTS_NOT_TAKEN
    from sparrow.entrypoints.cli_errors import explain_vllm_flags

    message = explain_vllm_flags("unrecognized arguments: --swap-space 4 --headless --no-such-flag -O3")
    assert message.startswith("--swap-space (vLLM's) is not taken: " + VLLM_ARGUMENTS_NOT_TAKEN["swap_space"]), message
    assert "; --headless (vLLM's) is not taken: data parallelism runs on one machine here" in message
    assert "; -O3 (vLLM's) is not taken: Sparrow does not compile the model" in message
    assert message.endswith("; unrecognized arguments: --no-such-flag"), message
    assert explain_vllm_flags("unrecognized arguments: --nope") == "unrecognized arguments: --nope"
    assert explain_vllm_flags("argument --port: invalid") == "argument --port: invalid"
    result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "/nonexistent-model",
                             "--max_num_partial_prefills=2"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("sparrow: error: --max-num-partial-prefills (vLLM's) is not taken: "
                                            "vLLM V0's limit"), result.stderr
