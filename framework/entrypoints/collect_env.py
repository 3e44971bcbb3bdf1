"""``sparrow collect-env`` (vLLM's ``vllm collect-env``): what a bug report needs, the Sparrow,
Python and OS versions, the CPU and the instruction sets Sparrow's CPU kernels use, torch and its
CUDA build and GPUs, the versions of the packages Sparrow relies on, the installed plugins and the
environment variables that change Sparrow's behaviour (values of names with KEY, TOKEN, SECRET or
PASSWORD hidden). Every section is probed on its own: one that fails shows its error, the rest
still print, and nothing here needs torch to be importable."""

from __future__ import annotations

import os
import sys
from typing import Any

from sparrow.entrypoints.cli_clients import ENV_API_KEY
from sparrow.entrypoints.cli_http import one_line

# The distributions whose versions a bug report needs (importlib.metadata names).
PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "flashinfer-python", "numpy", "pyzmq",
            "msgspec", "pydantic", "fastapi", "uvicorn", "pluggy", "xgrammar", "openai")
# /proc/cpuinfo flags that decide which of Sparrow's CPU kernels (and oneDNN's) run.
X86_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "avx512_vnni",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
ARM_FLAGS = ("asimd", "asimddp", "asimdhp", "sve", "sve2", "bf16", "i8mm")
# Variables other than SPARROW_* that change how Sparrow, torch or the tokenizer behave.
OTHER_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
                   "TORCH_CUDA_ARCH_LIST", "NCCL_DEBUG", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                   "TOKENIZERS_PARALLELISM", ENV_API_KEY)
HIDDEN_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def _probe(function: Any, *args: Any) -> Any:
    """``function(*args)``, or the error it raised as text: collect-env never fails."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001 - whatever broke is part of the report
        return f"unknown ({type(exc).__name__}: {one_line(str(exc))})"


def package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpuinfo() -> dict[str, str]:
    """The first value of each key of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, sep, value = line.partition(":")
                if sep:
                    info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_section() -> list[tuple[str, str]]:
    import platform

    info = _cpuinfo()
    model = info.get("model name") or info.get("Model") or info.get("Hardware") or platform.processor() or "unknown"
    cores = str(os.cpu_count())
    if hasattr(os, "sched_getaffinity"):
        cores += f" ({len(os.sched_getaffinity(0))} usable by this process)"
    rows = [("model", model), ("architecture", platform.machine() or "unknown"), ("logical cores", cores)]
    wanted: tuple[str, ...]
    if "flags" in info:
        flags, wanted = set(info["flags"].split()), X86_FLAGS
    elif "Features" in info:
        flags, wanted = set(info["Features"].split()), ARM_FLAGS
    else:
        return rows + [("instruction sets", "unknown (no /proc/cpuinfo flags)")]
    rows.append(("instruction sets", " ".join(flag for flag in wanted if flag in flags) or "none of those below"))
    rows.append(("absent", " ".join(flag for flag in wanted if flag not in flags) or "none"))
    return rows


def _nvidia_driver() -> str:
    import shutil
    import subprocess

    path = shutil.which("nvidia-smi")
    if path is None:
        return "nvidia-smi not found"
    result = subprocess.run([path, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                            text=True, timeout=20, check=False)
    versions = sorted({line.strip() for line in result.stdout.splitlines() if line.strip()})
    return ", ".join(versions) or f"unknown (nvidia-smi: {one_line(result.stderr)})"


def torch_section() -> list[tuple[str, str]]:
    try:
        import torch
    except ImportError:
        return [("torch", "not installed")]
    except Exception as exc:  # noqa: BLE001 - a broken install is what the report is for
        return [("torch", f"import failed ({type(exc).__name__}: {one_line(str(exc))})")]
    rows = [("version", torch.__version__),
            ("debug build", str(torch.version.debug)),
            ("CUDA build", torch.version.cuda or "none (a CPU-only build)")]
    if getattr(torch.version, "hip", None):
        rows.append(("ROCm (HIP) build", str(torch.version.hip)))
    rows.append(("cuDNN", _probe(lambda: str(torch.backends.cudnn.version() or "none"))))
    rows.append(("CPU capability", _probe(lambda: str(torch.backends.cpu.get_cpu_capability()))))
    rows.append(("threads", _probe(lambda: str(torch.get_num_threads()))))
    available = _probe(torch.cuda.is_available)
    rows.append(("torch.cuda.is_available()", str(available)))
    if available is True:
        count = _probe(torch.cuda.device_count)
        for index in range(count if isinstance(count, int) else 0):
            rows.append((f"GPU {index}", _probe(_gpu, torch, index)))
        rows.append(("NVIDIA driver", _probe(_nvidia_driver)))
    return rows


def _gpu(torch: Any, index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return (f"{props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / (1 << 30):.1f} GiB")


def plugins_section() -> list[tuple[str, str]]:
    from importlib.metadata import entry_points

    from sparrow.hookspecs import PROJECT_NAME

    allowed = os.environ.get("SPARROW_PLUGINS")
    allowed_names = None if allowed is None else {name.strip() for name in allowed.split(",") if name.strip()}
    rows = []
    for ep in sorted(entry_points(group=PROJECT_NAME), key=lambda ep: ep.name):
        dist = getattr(ep, "dist", None)
        origin = f" ({dist.metadata['Name']} {dist.version})" if dist is not None else ""
        skipped = "" if allowed_names is None or ep.name in allowed_names else ", not loaded: not in SPARROW_PLUGINS"
        rows.append((ep.name, f"{ep.value}{origin}{skipped}"))
    return rows or [("(none)", f"no entry point in the {PROJECT_NAME!r} group")]


def hidden(name: str) -> bool:
    return any(word in name.upper() for word in HIDDEN_WORDS)


def environment_section(sparrow_environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The SPARROW_* variables (of ``sparrow_environ``, else of this process) and the few others
    in OTHER_VARIABLES, the values of names with a word of HIDDEN_WORDS hidden."""
    environ = {name: value for name, value in os.environ.items() if name in OTHER_VARIABLES}
    if sparrow_environ is None:
        sparrow_environ = {name: value for name, value in os.environ.items() if name.startswith("SPARROW_")}
    environ.update(sparrow_environ)
    names = sorted(sparrow_environ) + [name for name in OTHER_VARIABLES if name in environ]
    return [(name, "*** (set, hidden)" if hidden(name) else environ[name]) for name in names] or [
        ("(none)", "no SPARROW_* variable is set")]


def collect_env(sparrow_environ: dict[str, str] | None = None) -> list[tuple[str, list[tuple[str, str]]]]:
    """(section title, [(name, value), ...]) of everything ``sparrow collect-env`` prints."""
    import platform

    import sparrow

    system = [("Sparrow", f"{sparrow.__version__} ({os.path.dirname(os.path.abspath(sparrow.__file__))})"),
              ("Python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
              ("OS", platform.platform()),
              ("libc", " ".join(part for part in platform.libc_ver() if part) or "unknown")]

    def section(rows: Any) -> list[tuple[str, str]]:
        return rows if isinstance(rows, list) else [("error", str(rows))]

    return [("System", system),
            ("CPU", section(_probe(cpu_section))),
            ("PyTorch", section(_probe(torch_section))),
            ("Packages", [(name, _probe(package_version, name)) for name in PACKAGES]),
            ("Sparrow plugins", section(_probe(plugins_section))),
            ("Environment variables", section(_probe(environment_section, sparrow_environ)))]


def print_environment(sparrow_environ: dict[str, str] | None = None) -> int:
    """``sparrow collect-env``: print the report; the exit code."""
    print("Collecting environment information...", file=sys.stderr)
    for title, rows in collect_env(sparrow_environ):
        print(f"== {title} ==")
        width = max(len(name) for name, _ in rows)
        for name, value in rows:
            print(f"{name + ':':<{width + 1}} {value}")
        print()
    return 0
