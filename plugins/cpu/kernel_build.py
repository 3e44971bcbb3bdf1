"""Build a C++ extension once per (torch, compiler, Python, CPU, source) and load it without ninja.

torch's ``load_inline`` builds into one directory per extension name, shared by every environment
of the user, and runs ninja on every load. Two virtual environments then rewrite each other's
``build.ninja`` (it names each one's include paths) and rebuild in turn, blocking each other on the
directory's lock; a different ``ninja`` on PATH (an activated venv against ``.venv/bin/sparrow``)
rebuilds too, since the two versions keep incompatible logs. So the directory here is named by a
hash of everything the binary depends on::

    ~/.cache/torch_extensions/sparrow/<name>-<key>/   ($TORCH_EXTENSIONS_DIR moves the root)
                                                      key: sha256 of build_identity(), 16 hex
        build.ninja, main.cpp, <name>.so          written by load_inline
        built.json                                written last: the library's file name + identity

and a directory whose ``built.json`` and library exist is imported directly: no ninja, no lock,
no compiler run. Environments with the same torch, compiler and Python share one build; any
difference (another torch, a compiler upgrade, an edited kernel or flag, a CPU with other
instruction sets: the kernels use ``-march=native``) gets a directory of its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

MARKER = "built.json"


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """One ``load_inline`` extension: its module name, C++ sources, exported functions and flags."""

    name: str
    sources: tuple[str, ...]
    functions: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()


def compiler_identity() -> str:
    """The C++ compiler torch would call (``$CXX`` or ``c++`` on PATH): resolved path and version."""
    compiler = os.environ.get("CXX", "c++")
    path = shutil.which(compiler)
    if path is None:
        return f"{compiler}: not found"
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"unknown ({exc})"
    lines = version.splitlines()
    return f"{os.path.realpath(path)}: {lines[0] if lines else ''}"


def cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU model and its instruction-set flags."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = hashlib.sha256(value.strip().encode()).hexdigest()[:16]
                if model and flags:
                    break
    except OSError:
        pass
    return f"{platform.machine()} {model or platform.processor()} flags={flags or 'unknown'}"


def build_identity(build: KernelBuild) -> dict[str, str]:
    """Everything the built binary depends on; any change gives another build directory."""
    import torch

    source = hashlib.sha256("\0".join(build.sources).encode()).hexdigest()
    return {
        "name": build.name,
        "torch": f"{torch.__version__} git={torch.version.git_version} "
                 f"cxx11_abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "compiler": compiler_identity(),
        "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
        "cpu": cpu_identity(),
        "source_sha256": source,
        "functions": ",".join(build.functions),
        "cflags": " ".join(build.cflags),
        "ldflags": " ".join(build.ldflags),
    }


def build_key(identity: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def kernels_root() -> Path:
    """torch's extension root (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).

    Not Sparrow's model cache: tests and users move that one per session, and a compile per
    session would cost a minute each time.
    """
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "sparrow"


def build_directory(build: KernelBuild, identity: dict[str, str] | None = None) -> Path:
    identity = build_identity(build) if identity is None else identity
    return kernels_root() / f"{build.name}-{build_key(identity)}"


def load_kernels(build: KernelBuild) -> ModuleType:
    """The extension module, built first if this directory has no finished build.

    Raises whatever the build raises (no compiler, a compile error); the caller decides the
    fallback.
    """
    identity = build_identity(build)
    directory = build_directory(build, identity)
    module = _load_finished(directory)
    if module is not None:
        logger.debug("loaded %s from %s", build.name, directory)
        return module

    from torch.utils.cpp_extension import load_inline

    logger.info("compiling the CPU C++ kernels into %s; this takes about a minute, once per torch, "
                "compiler and Python version", directory)
    directory.mkdir(parents=True, exist_ok=True)
    # load_inline takes the directory's lock: a second process building the same key waits for
    # the first and then finds ninja's work done.
    module = load_inline(name=build.name, cpp_sources=list(build.sources), functions=list(build.functions),
                         extra_cflags=list(build.cflags), extra_ldflags=list(build.ldflags),
                         build_directory=str(directory), verbose=False)
    _write_marker(directory, Path(module.__file__).name, identity)
    return module


def _load_finished(directory: Path) -> ModuleType | None:
    try:
        library = json.loads((directory / MARKER).read_text())["library"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = directory / library
    if not path.is_file():
        return None
    # The library links against libtorch by soname: torch must be loaded first.
    import torch  # noqa: F401

    # The module name must match the library's PyInit_ symbol, which load_inline named after it.
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # a damaged or foreign file: build it again
        logger.warning("could not load %s (%s); building it again", path, exc)
        return None
    return module


def _write_marker(directory: Path, library: str, identity: dict[str, str]) -> None:
    # Written last and renamed into place, so a reader never sees a marker before the library.
    staging = directory / f".{MARKER}.{os.getpid()}"
    staging.write_text(json.dumps({"library": library, "identity": identity}, indent=2))
    os.replace(staging, directory / MARKER)
