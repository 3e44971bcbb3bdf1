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
