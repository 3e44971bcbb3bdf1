"""The engine core's scheduling and memory code must never load torch (or numpy).

Each check imports the modules in a fresh interpreter, since this test process may already have
torch loaded by other tests.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

KV_CACHE_MODULES = (
    "sparrow.core.kv_cache_utils",
    "sparrow.core.block_pool",
    "sparrow.core.kv_cache_manager",
    "sparrow.core.request",
)
SCHEDULER_MODULES = ("sparrow.core.sched.interface", "sparrow.core.sched.scheduler")
HEAVY_MODULES = ("torch", "numpy")


def assert_imports_stay_light(modules: tuple[str, ...]) -> None:
    code = "\n".join(
        [f"import {module}" for module in modules]
        + [
            "import sys",
            f"loaded = sorted(name for name in {HEAVY_MODULES!r} if name in sys.modules)",
            "assert not loaded, f'loaded {loaded}'",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_kv_cache_modules_do_not_import_torch() -> None:
    assert_imports_stay_light(KV_CACHE_MODULES)


def test_scheduler_modules_do_not_import_torch() -> None:
    missing = [module for module in SCHEDULER_MODULES if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"not written yet: {', '.join(missing)}")
    assert_imports_stay_light(SCHEDULER_MODULES + KV_CACHE_MODULES)


def test_the_engine_core_process_modules_do_not_import_torch() -> None:
    """The engine-core process configures OpenMP (its threads' wait policy) before torch loads: a
    module of its own that imports torch at the top spins every OpenMP thread of the process and
    slows every test beside it (sleep mode's worker module once did)."""
    assert_imports_stay_light(("sparrow.engine.core", "sparrow.engine.core_proc", "sparrow.engine.sleep_args"))
