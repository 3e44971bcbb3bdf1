#!/usr/bin/env python3
"""Build an offline wheelhouse of Sparrow's runtime dependencies for an air-gapped machine.

GPU clusters often have torch (and CUDA) installed but no network. This downloads binary wheels
of everything else Sparrow needs, for a target Python version and platform, plus a wheel of
Sparrow itself, so the target installs with:

    python3 -m pip install --no-index --find-links WHEELHOUSE sparrow-llm

Usage:
    python3 scripts/build_wheelhouse.py --python-version 3.12 --dest wheelhouse/
    python3 scripts/build_wheelhouse.py --python-version 3.12 --dest .whl --flat-target  # device runs

torch, triton and the NVIDIA libraries are excluded by default (the target has them); pass
``--include-torch`` to add them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# Runtime dependencies without torch; transformers' own needs come along through pip's resolver.
RUNTIME = [
    "pluggy", "pyzmq", "msgspec", "pydantic", "importlib-metadata", "fastapi", "uvicorn",
    "prometheus-client", "tqdm", "numpy", "safetensors", "tokenizers", "transformers", "ninja",
]
PLATFORMS = [
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux1_x86_64",
]
EXCLUDED_PREFIXES = ("torch", "triton", "nvidia-", "nvidia_")


def download(packages: list[str], dest: Path, python_version: str, no_deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    if no_deps:
        cmd.append("--no-deps")
    subprocess.run(cmd + packages, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    parser.add_argument("--dest", default="wheelhouse")
    parser.add_argument("--packages", nargs="*", default=None, help="override the package list")
    parser.add_argument("--no-deps", action="store_true",
                        help="only the named packages (the target already has the rest)")
    parser.add_argument("--include-torch", action="store_true")
    parser.add_argument("--no-sparrow", action="store_true", help="do not build a wheel of Sparrow itself")
    args = parser.parse_args()

    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    packages = args.packages or RUNTIME
    download(packages, dest, args.python_version, args.no_deps)
    if not args.include_torch:
        for wheel in dest.glob("*.whl"):
            if wheel.name.lower().startswith(EXCLUDED_PREFIXES):
                wheel.unlink()
    if not args.no_sparrow:
        root = Path(__file__).resolve().parents[1]
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest),
                        str(root)], check=True)
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    print(f"{len(wheels)} wheels in {dest}:")
    for name in wheels:
        print("  " + name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
