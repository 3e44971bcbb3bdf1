"""The CPU engine's threads: how many (never more than the cores, shared between engine processes)
and how they wait (OpenMP passive, set before torch loads), as the engine process reports them."""

from __future__ import annotations

import os

import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import EngineConfig
from sparrow.platforms import resolve_platform
from sparrow_cpu import threads
from sparrow_cpu.worker import CpuWorker

OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS", threads.ENV_CPU_THREADS)


@pytest.fixture
def clean_thread_env(monkeypatch):
    for name in OPENMP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _settings_and_output(llm: LLM) -> tuple[dict, str]:
    [settings] = llm.collective_rpc("thread_settings")
    [output] = llm.generate(["The capital"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    return settings, output.outputs[0].text


def test_engine_process_waits_passively_on_its_share_of_the_cores(clean_thread_env, capfd):
    clean_thread_env.setenv("SPARROW_LOGGING_LEVEL", "INFO")
    with LLM(kv_cache_memory_bytes=1 << 24) as llm:
        settings, text = _settings_and_output(llm)
    assert settings["openmp_configured_before_load"] is True
    assert settings["OMP_WAIT_POLICY"] == "PASSIVE"
    assert settings["GOMP_SPINCOUNT"] == threads.OPENMP_DEFAULTS["GOMP_SPINCOUNT"]
    assert settings["num_threads"] == threads.usable_cores()
    assert text
    # The caller's process is left alone: its OpenMP had loaded, its environment is unchanged.
    assert "OMP_WAIT_POLICY" not in os.environ
    log = capfd.readouterr().err
    assert log.count("CPU threads: ") == 1
    assert f"CPU threads: {threads.usable_cores()} per engine process" in log
    assert "OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=5000" in log


def test_the_users_settings_win(clean_thread_env):
    clean_thread_env.setenv(threads.ENV_CPU_THREADS, "1")
    clean_thread_env.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with LLM(kv_cache_memory_bytes=1 << 24) as llm:
        settings, text = _settings_and_output(llm)
    assert settings["num_threads"] == 1
    assert settings["OMP_WAIT_POLICY"] == "ACTIVE"
    assert settings["GOMP_SPINCOUNT"] is None  # no default mixed into the user's choice
    assert text


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_count_names_the_variable(clean_thread_env, value):
    clean_thread_env.setenv(threads.ENV_CPU_THREADS, value)
    with pytest.raises(ValueError, match=threads.ENV_CPU_THREADS):
        threads.num_threads()


def test_engine_processes_share_the_cores(clean_thread_env):
    cores = threads.usable_cores()
    assert threads.num_threads(1)[0] == cores
    assert threads.num_threads(2)[0] == max(1, cores // 2)
    assert threads.num_threads(4 * cores)[0] == 1
    platform = resolve_platform("cpu")
    for dp, tp, expected in ((1, 1, 1), (2, 1, 2), (2, 2, 4), (1, 4, 4)):
        config = EngineConfig.from_kwargs(data_parallel_size=dp, tensor_parallel_size=tp, max_model_len=64)
        worker = CpuWorker(config=config, platform=platform, rank=0, local_rank=0, world_size=tp)
        assert worker.engine_processes_on_machine() == expected


def test_too_late_to_configure_is_reported_and_changes_nothing(clean_thread_env):
    import torch  # noqa: F401 - this process has OpenMP loaded, as a user's process usually does

    assert threads.openmp_loaded()
    assert threads.configure_openmp() is False
    assert "OMP_WAIT_POLICY" not in os.environ
