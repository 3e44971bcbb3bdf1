"""Shared fixtures: tiny models built locally (random weights, fixed seeds) once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Remote-code directories (tests/test_remote_code.py) are copied into transformers' module cache:
# a directory of this run, removed at exit, not ~/.cache/huggingface/modules. Set before anything
# imports transformers, which reads it once; engine processes inherit it.
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="sparrow-test-hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)
# A 0.25 GiB CPU KV cache (16k tokens of sparrow-tiny, far more of the test models) instead of the
# default 1 GiB, which every engine start fills with zeros (~0.5 s CPU, over a hundred starts).
# Set in os.environ so that engine processes, `sparrow` subprocesses and docs examples inherit it;
# tests that depend on the cache size set kv_cache_memory_bytes or num_kv_blocks themselves.
os.environ.setdefault("SPARROW_CPU_KVCACHE_SPACE", "0.25")
# The engine's OpenMP wait policy (sparrow_cpu.threads: spin 5,000 times, then sleep) for the test
# processes too: it must be set before anything loads torch, and this is the only place that runs
# that early. Without it an in-process engine (multiprocess=False, the layer and kernel tests) keeps
# libgomp's default of spinning ~3 ms at every barrier, and beside the other xdist worker on a
# 2-core machine every parallel region waits for a time slice: tests/test_spec_draft.py took 80 s
# instead of 21 s beside one busy process. configure_openmp leaves a user's own setting alone, as
# the engine does; engine processes inherit the values they would set themselves, and
# tests/test_cpu_threads.py clears them to check the engine's defaults.
from sparrow_cpu import threads as _cpu_threads  # noqa: E402 - torch-free

_cpu_threads.configure_openmp()

# Hypothesis' default 200 ms deadline per example is a timing assertion: on CI's 2 cores, beside
# the other xdist worker, a pure-Python example can take longer and fail for no bug.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("sparrow", deadline=None)
_hypothesis_settings.load_profile("sparrow")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _sparrow_cache(tmp_path_factory):
    """The built-in model is built into a per-session cache, never into the user's home."""
    if "SPARROW_CACHE_DIR" not in os.environ:
        os.environ["SPARROW_CACHE_DIR"] = str(tmp_path_factory.mktemp("sparrow-cache"))
    yield


@pytest.fixture(autouse=True)
def _restore_sparrow_environment():
    """Tests that run the CLI in this process (``cli.main([...])``) set SPARROW_* variables, such
    as SPARROW_LOGGING_LEVEL, for the processes a command starts; restore them after every test,
    so that a later test's subprocess (a server) does not inherit another test's settings."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("SPARROW_")}
    yield
    for name in [name for name in os.environ if name.startswith("SPARROW_") and name not in saved]:
        del os.environ[name]
    os.environ.update(saved)


# arch -> build_model_dir overrides. Llama covers GQA with unequal head counts, untied embeddings
# and llama3 rope scaling; Qwen2 adds QKV bias; Qwen3 q/k norms.
PARITY_MODELS = {
    "llama": dict(arch="llama", preset="test", seed=1, tie_word_embeddings=False, rope_scaling="llama3"),
    "qwen2": dict(arch="qwen2", preset="test", seed=2, tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", preset="test", seed=3, tie_word_embeddings=False),
}


def build_test_model(out_dir, arch: str, preset: str = "test", seed: int = 0, **overrides):
    from sparrow.tiny.model import LLAMA3_ROPE_SCALING, build_model_dir

    if overrides.get("rope_scaling") == "llama3":
        overrides["rope_scaling"] = dict(LLAMA3_ROPE_SCALING)
    build_model_dir(out_dir, arch=arch, preset=preset, seed=seed, save_dtype="float32", **overrides)
    return str(out_dir)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """arch -> directory of a small test model of that architecture (with tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    return {name: build_test_model(root / name, **spec) for name, spec in PARITY_MODELS.items()}


@pytest.fixture(scope="session")
def qwen3_dir(model_dirs) -> str:
    return model_dirs["qwen3"]
