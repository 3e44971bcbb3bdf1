"""SPARROW_CPU_KVCACHE_SPACE: the CPU KV cache size in GiB when kv_cache_memory_bytes is unset
(vLLM's VLLM_CPU_KVCACHE_SPACE). tests/conftest.py sets it for the whole session."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparrow_cpu import worker as cpu_worker


def budget(kv_cache_memory_bytes: int | None) -> int:
    # available_kv_cache_bytes reads only the cache config: a stand-in worker is enough.
    stand_in = SimpleNamespace(config=SimpleNamespace(cache=SimpleNamespace(
        kv_cache_memory_bytes=kv_cache_memory_bytes)))
    return cpu_worker.CpuWorker.available_kv_cache_bytes(stand_in)


def test_the_variable_sets_the_default_and_the_engine_argument_wins(monkeypatch):
    monkeypatch.setenv(cpu_worker.ENV_KVCACHE_SPACE, "0.5")
    assert budget(None) == 1 << 29
    assert budget(12345) == 12345
    monkeypatch.setenv(cpu_worker.ENV_KVCACHE_SPACE, " 2 ")
    assert budget(None) == 2 << 30
    monkeypatch.delenv(cpu_worker.ENV_KVCACHE_SPACE)
    assert 0 < budget(None) <= cpu_worker.DEFAULT_MAX_BYTES


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "nan", "inf", "1GiB"])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv(cpu_worker.ENV_KVCACHE_SPACE, bad)
    with pytest.raises(ValueError, match=f"SPARROW_CPU_KVCACHE_SPACE must be a number of GiB > 0, got '{bad}'"):
        budget(None)
    assert budget(4096) == 4096  # unread when the engine argument is set


def test_the_engine_process_reads_it(monkeypatch):
    from sparrow import LLM

    monkeypatch.setenv(cpu_worker.ENV_KVCACHE_SPACE, "0.125")
    with LLM(max_model_len=256) as llm:
        info = llm.llm_engine.engine_core.call_utility("get_kv_cache_info")
        # sparrow-tiny in float32: 8 layers x (K, V) x 4 KV heads x 64 x 4 bytes = 16 KiB a token.
        assert info["num_blocks"] * info["block_size"] * 16 * 1024 == 1 << 27, info


@pytest.mark.parametrize("bad", ["0", "abc"])
def test_a_bad_value_is_refused_before_any_process_starts(monkeypatch, bad):
    """The frontend refuses it as a configuration error naming the variable, before it starts
    the engine process (whose start-up failure would otherwise bury the message)."""
    from sparrow import LLM
    from sparrow.config import ConfigError

    monkeypatch.setenv(cpu_worker.ENV_KVCACHE_SPACE, bad)
    started = []
    monkeypatch.setattr("sparrow.engine.launch.start_process", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError, match="SPARROW_CPU_KVCACHE_SPACE must be a number of GiB > 0"):
        LLM(max_model_len=256)
    assert not started
    monkeypatch.undo()  # the real start_process again; the variable stays bad, but the argument wins
    monkeypatch.setenv(cpu_worker.ENV_KVCACHE_SPACE, bad)
    with LLM(max_model_len=256, kv_cache_memory_bytes=1 << 26, multiprocess=False) as llm:
        assert llm.generate(["hi"], use_tqdm=False)[0].outputs[0].text is not None
