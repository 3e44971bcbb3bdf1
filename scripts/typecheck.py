"""Run mypy on the kernel's typed packages.

The source layout maps directories onto import names (setup.py: ``framework`` is ``sparrow``,
``hookspecs`` is ``sparrow.hookspecs``) and an editable install resolves them through an import
hook that mypy does not run; so this script lays the packages out under their import names as
symlinks in a temporary directory and points mypy there.

    python scripts/typecheck.py            # the packages CI checks
    python scripts/typecheck.py sparrow.engine   # others, by import name
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# import name -> source directory (as in setup.py)
LAYOUT = {"sparrow": "framework", "sparrow_schedulers": "plugins/schedulers", "sparrow_cpu": "plugins/cpu",
          "sparrow_cuda": "plugins/builtin_cuda"}
# What CI keeps clean: the kernel's scheduling and memory code, the plugin contract, the sampler,
# the worker and the executors.
CHECKED = ("sparrow.hookspecs", "sparrow.core", "sparrow.ops", "sparrow.plugins", "sparrow.config",
           "sparrow.config_base", "sparrow.config_model",
           "sparrow.interfaces", "sparrow.wire", "sparrow.errors", "sparrow.platforms", "sparrow.sample",
           "sparrow.worker", "sparrow.executor", "sparrow.utils", "sparrow.param_checks",
           "sparrow.plugin_files", "sparrow.logprobs", "sparrow.model_registry")


def build_tree(dest: Path) -> None:
    for name, src in LAYOUT.items():
        package = dest / name
        package.mkdir()
        for entry in (ROOT / src).iterdir():
            if entry.name != "__pycache__":
                (package / entry.name).symlink_to(entry)
    (dest / "sparrow" / "hookspecs").symlink_to(ROOT / "hookspecs")


def main(argv: list[str]) -> int:
    packages = argv or [p for p in CHECKED if _exists(p)]
    with tempfile.TemporaryDirectory(prefix="sparrow-mypy-") as tmp:
        build_tree(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        for package in packages:
            cmd += ["-p", package]
        return subprocess.call(cmd, cwd=tmp, env={**os.environ, "MYPYPATH": tmp})


def _exists(package: str) -> bool:
    parts = package.split(".")
    base = ROOT / LAYOUT[parts[0]]
    if parts[1:] == ["hookspecs"]:
        return True
    path = base.joinpath(*parts[1:])
    return path.is_dir() or path.with_suffix(".py").is_file()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
