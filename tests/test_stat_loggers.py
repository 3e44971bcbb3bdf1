"""Custom stat loggers (vLLM's ``StatLoggerBase``): given as classes to ``LLM`` / ``AsyncLLM``, by
``package.module:Class`` or by a plugin's registered name, they see the same figures as the
built-in stats line and Prometheus metrics, and those figures are what the outputs show."""

from __future__ import annotations

import asyncio
import logging

import pluggy
import pytest

from sparrow import LLM, AsyncLLM, SamplingParams
from sparrow.config import ConfigError, EngineConfig
from sparrow.engine.preflight import check_engine_config
from sparrow.engine.stat_loggers import resolve_stat_logger
from sparrow.hookspecs import PROJECT_NAME
from sparrow.plugins import build_registry
from sparrow.v1.metrics.loggers import StatLoggerBase
from tests import stat_logger_plugin
from tests.stat_logger_plugin import RecordingStatLogger

PATH = "tests.stat_logger_plugin:RecordingStatLogger"
SMALL = {"max_model_len": 256, "max_num_seqs": 8}


def sample_counts(outputs) -> tuple[int, int, list[str]]:
    """(prompt tokens, generated tokens, finish reasons) summed over every sample of every output."""
    prompt = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return prompt, generated, sorted(c.finish_reason for o in outputs for c in o.outputs)


def test_every_logger_counts_what_the_outputs_show(qwen3_dir):
    # The class itself (stays in this process) and the same class by import path (an engine argument).
    with LLM(qwen3_dir, stat_loggers=[RecordingStatLogger], disable_log_stats=False, log_stats_interval=3600,
             **SMALL) as llm:
        engine = llm.llm_engine
        (custom,) = [x for x in engine.stat_loggers.loggers if isinstance(x, RecordingStatLogger)]
        assert custom.initialized == 1 and custom.engine_index == 0 and custom.config is engine.config
        prompts = ["The sky is", "Once upon a time there", {"prompt_token_ids": [5, 9, 14, 3, 7, 11]}]
        params = [SamplingParams(max_tokens=7, ignore_eos=True), SamplingParams(max_tokens=3, n=2, seed=1),
                  SamplingParams(max_tokens=12, ignore_eos=True)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        # One request aborted after it started: it finishes as "abort", once.
        engine.add_request("gone", "A request that is aborted", SamplingParams(max_tokens=50, ignore_eos=True))
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass
        engine.abort_request("gone")
        metrics = {m.name: m for m in llm.get_metrics()}

    prompt, generated, reasons = sample_counts(outputs)
    finished = custom.finished()
    assert sorted(done.finish_reason for done in finished) == sorted([*reasons, "abort"])
    aborted = next(done for done in finished if done.finish_reason == "abort")
    assert aborted.num_generation_tokens >= 1 and aborted.time_to_first_token is not None
    prompt += aborted.num_prompt_tokens
    generated += aborted.num_generation_tokens
    assert custom.total("num_prompt_tokens") == prompt
    assert custom.total("num_generation_tokens") == generated
    assert sum(done.num_generation_tokens for done in finished) == generated
    assert sum(len(i.time_to_first_tokens_iter) for i in custom.iterations) == len(finished) == 5
    assert sum(len(i.inter_token_latencies_iter) for i in custom.iterations) > 0
    by_max = sorted((done.max_tokens_param, done.num_generation_tokens) for done in finished
                    if done.finish_reason == "length")
    assert (7, 7) in by_max and (12, 12) in by_max
    # The scheduler's counters arrive as growths: their sum is the last cumulative snapshot.
    assert sum(s.prefix_cache_queries for s in custom.scheduler_stats) == engine.last_stats.prefix_cache_queries
    # The stats line and the Prometheus metrics read the same figures.
    line = engine.stat_logger
    assert (line.num_prompt_tokens, line.num_generation_tokens) == (prompt, generated)
    assert metrics["sparrow:prompt_tokens"].value == prompt
    assert metrics["sparrow:generation_tokens"].value == generated
    assert metrics["sparrow:request_generation_tokens"].sum == generated
    assert metrics["sparrow:time_to_first_token_seconds"].count == 5


class Broken(RecordingStatLogger):
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        raise RuntimeError("a bug in the logger")


def test_async_llm_feeds_custom_loggers_and_drops_one_that_raises(caplog):
    made = []

    def factory(config, engine_index):  # any callable (config, engine_index) -> logger
        made.append(RecordingStatLogger(config, engine_index))
        return made[-1]

    async def main():
        engine = AsyncLLM.from_engine_args(model=None, stat_loggers=[factory, Broken, PATH], **SMALL)
        try:
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            finals = []
            for i in range(3):
                async for out in engine.generate(f"prompt {i}", params, f"req-{i}"):
                    pass
                finals.append(out)
            # Aborted while it runs: recorded as "abort" at once, not with a later batch.
            stream = engine.generate("long one", SamplingParams(max_tokens=200, ignore_eos=True), "long")
            await stream.__anext__()
            await engine.abort("long")
            return engine, finals
        finally:
            engine.shutdown()

    caplog.set_level(logging.ERROR, logger="sparrow.engine.stat_loggers")
    engine, finals = asyncio.run(main())
    by_path = next(x for x in engine.stat_loggers.loggers if isinstance(x, RecordingStatLogger) and x not in made)
    assert not any(isinstance(x, Broken) for x in engine.stat_loggers.loggers)
    assert "stat logger Broken raised in record(); it is disabled" in caplog.text
    prompt, generated, reasons = sample_counts(finals)
    for custom in (made[0], by_path):
        finished = custom.finished()
        assert sorted(done.finish_reason for done in finished) == sorted([*reasons, "abort"])
        long_one = next(done for done in finished if done.finish_reason == "abort")
        assert custom.total("num_generation_tokens") == generated + long_one.num_generation_tokens
        assert custom.total("num_prompt_tokens") == prompt + long_one.num_prompt_tokens
        assert custom.initialized == 1


def test_sparrow_register_stat_loggers_names_are_resolved_before_the_engine_starts(qwen3_dir):
    # A plugin's registered name, through the same registry `sparrow plugins` lists.
    pm = pluggy.PluginManager(PROJECT_NAME)
    from sparrow import hookspecs

    pm.add_hookspecs(hookspecs)
    pm.register(stat_logger_plugin, "recording-plugin")
    registry = build_registry(pm)
    assert resolve_stat_logger("recording", registry) is RecordingStatLogger
    with pytest.raises(ValueError, match="unknown stat logger 'nope'; registered: recording") as info:
        resolve_stat_logger("nope", registry)
    assert info.value.field == "stat_loggers"
    # The engine argument: checked with the configuration, naming the field.
    with pytest.raises(ConfigError, match="stat_loggers") as info:
        check_engine_config(EngineConfig.from_kwargs(model=qwen3_dir, stat_loggers=["nope"]))
    assert "unknown stat logger 'nope'" in str(info.value)
    with pytest.raises(ConfigError, match="cannot import 'tests.no_such_module:X'"):
        check_engine_config(EngineConfig.from_kwargs(model=qwen3_dir, stat_loggers=["tests.no_such_module:X"]))
    # A class is kept as its import path; a local class or a factory must go to a constructor.
    config = EngineConfig.from_kwargs(model=qwen3_dir, stat_loggers=[RecordingStatLogger])
    assert config.observability.stat_loggers == [PATH]

    class Local(RecordingStatLogger):
        pass

    with pytest.raises(ConfigError, match="stat_loggers.*LLM\\(stat_loggers=...\\)"):
        EngineConfig.from_kwargs(model=qwen3_dir, stat_loggers=[Local])
    assert issubclass(RecordingStatLogger, StatLoggerBase)
