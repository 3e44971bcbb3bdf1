"""The C++ kernels' build directory is keyed by what the binary depends on, and a finished build
loads in a fresh process without ninja, without a compile and without the "compiling" line."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from sparrow_cpu.kernel_build import KernelBuild, build_directory, build_identity
from sparrow_cpu.native import kernel_build

# TORCH_INDUCTOR_CPP_WRAPPER makes the <torch/extension.h> that load_inline puts before the source
# skip torch/all.h (the C++ frontend, which add_one does not use): a real compile through ninja
# still, in about 60 % of the time (the headers' parsing is nearly all of it).
TINY = KernelBuild(name="sparrow_test_add_one", sources=("int64_t add_one(int64_t x) { return x + 1; }",),
                   functions=("add_one",), cflags=("-O1", "-DTORCH_INDUCTOR_CPP_WRAPPER"))
COMPILING = "compiling the CPU C++ kernels"

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None,
                                    reason="needs a C++ compiler and ninja")


def test_every_input_of_the_binary_changes_the_directory():
    identity = build_identity(TINY)
    directories = {build_directory(TINY, identity)}
    for field in ("torch", "compiler", "python", "cpu", "source_sha256", "cflags", "ldflags"):
        directories.add(build_directory(TINY, {**identity, field: identity[field] + " (another)"}))
    assert len(directories) == 8
    # The real inputs, not only the recorded ones: an edited kernel, another flag.
    edited = dataclasses.replace(TINY, sources=("int64_t add_one(int64_t x) { return 1 + x; }",))
    assert build_directory(edited) != build_directory(TINY)
    assert build_directory(dataclasses.replace(TINY, cflags=("-O2",))) != build_directory(TINY)
    # The same inputs give the same directory: environments that agree share one build.
    assert build_directory(TINY) == build_directory(TINY)


def test_identity_names_torch_python_and_the_compiler_version():
    identity = build_identity(kernel_build())
    assert torch.__version__ in identity["torch"]
    assert sys.implementation.cache_tag in identity["python"]
    assert "-march=native" in identity["cflags"]
    if shutil.which(os.environ.get("CXX", "c++")):
        assert "not found" not in identity["compiler"]
        assert any(char.isdigit() for char in identity["compiler"].partition(": ")[2])  # a version


def test_the_directory_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_directory(TINY).parent == tmp_path / "sparrow"


LOAD = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from sparrow_cpu.kernel_build import KernelBuild, load_kernels
    build = KernelBuild(name=sys.argv[1], sources=(sys.argv[2],), functions=("add_one",), cflags=tuple(sys.argv[3:]))
    module = load_kernels(build)
    print(module.add_one(41), module.__file__)
""")


def _load_in_fresh_process(env: dict[str, str]) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", LOAD, TINY.name, TINY.sources[0], *TINY.cflags], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@needs_compiler
def test_a_finished_build_loads_without_ninja_or_the_compile_line(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    out, err = _load_in_fresh_process(env)
    value, library = out.split()
    assert value == "42"
    assert err.count(COMPILING) == 1
    built_at = os.stat(library).st_mtime_ns

    # Another ninja first on PATH (an activated venv against the system's): it must not even run.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    called = tmp_path / "ninja-was-called"
    (fake_bin / "ninja").write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    (fake_bin / "ninja").chmod(0o755)
    out, err = _load_in_fresh_process({**env, "PATH": f"{fake_bin}{os.pathsep}{env['PATH']}"})
    assert out.split() == ["42", library]
    assert COMPILING not in err
    assert not called.exists()
    assert os.stat(library).st_mtime_ns == built_at
