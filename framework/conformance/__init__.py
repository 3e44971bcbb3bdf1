"""The conformance suite: the checks every Sparrow platform must pass.

Run it from the command line (a table of results; exit status 1 on any failure)::

    sparrow plugins --check DEVICE [--dtype DTYPE] [--only GROUP_OR_CHECK ...] [--model-dir DIR]

from Python (``only`` takes group names, ``group/name`` ids or shell patterns such as
``"engine/greedy*"``)::

    from sparrow.conformance import run_checks
    report = run_checks("cpu", only=["ops", "attention"])
    print(report.table()); assert report.ok

or as a pytest plugin in a vendor's own CI, one test per check (ids ``sparrow-conformance[DEVICE]::group/name``)::

    pytest -p sparrow.conformance.pytest_plugin --sparrow-device=DEVICE \
        [--sparrow-dtype=DTYPE] [--sparrow-only=GROUP_OR_CHECK,...] [--sparrow-model-dir=DIR]

The checks, in three groups:

- ``ops/<op>``, one per op of :data:`sparrow.ops.KERNEL_OPS`: the implementation the platform
  registered (``sparrow_register_ops``) against the op's torch reference on every case of
  :mod:`sparrow.ops.cases`, in the platform's default dtype (or ``dtype``) on
  ``platform.device_for_rank(0)``. An op with no registration shows "native" (the reference serves it).
- ``attention/paged[...]``: the backend ``sparrow_attention_backend`` gives for ``"auto"`` against a
  float32 reference of paged attention over three steps: fresh and chunked prefills, prefix-cache
  hits (context already in the cache, a block shared by two requests), mixed prefill/decode and
  decode-only batches; the KV cache must hold every token at its slot in the documented layout.
- ``engine/...``: greedy tokens equal to Hugging Face transformers on the built-in test
  architectures (llama, qwen2, qwen3; chunked prefill and a prefix-cached pass), seeded sampling
  independent of the batch, preemption and resumption under a tiny KV cache, and the
  shared_storage KV connector's producer/consumer round trip. These load tiny random-weight models
  built locally (no download) into ``model_dir`` (a temporary directory when None; given, it
  caches them between runs) and run the engine in-process with ``device=DEVICE``, in float32 when
  the platform supports it.

With ``SPARROW_CPU_THREADS=1`` the whole suite takes about a minute on the cpu platform.
"""

from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from sparrow.conformance.report import CheckResult, Report, ResultCallback, one_line

__all__ = ["Check", "CheckResult", "Report", "all_checks", "run_check", "run_checks", "select_checks"]

GROUPS = ("ops", "attention", "engine")
# The attention check's head layouts: name -> (num_heads, num_kv_heads, head_dim)
ATTENTION_SHAPES: dict[str, tuple[int, int, int]] = {"gqa, d64": (4, 2, 64), "mha, d128": (2, 2, 128)}


@dataclass(frozen=True, slots=True)
class Check:
    """One check: ``function(ctx, *args) -> (status, detail)``, imported when it runs."""

    group: str
    name: str
    function: str  # "module:function" inside sparrow.conformance
    args: tuple = ()

    @property
    def check_id(self) -> str:
        return f"{self.group}/{self.name}"

    def __call__(self, ctx: Any) -> tuple[str, str]:
        module_name, _, attr = self.function.partition(":")
        function: Callable[..., tuple[str, str]] = getattr(importlib.import_module(module_name), attr)
        return function(ctx, *self.args)


def all_checks() -> list[Check]:
    """Every check, in the order they run (the list does not depend on the platform)."""
    from sparrow.conformance.context import TEST_MODELS
    from sparrow.ops import KERNEL_OPS

    engine = "sparrow.conformance.engine"
    return [
        *(Check("ops", op, "sparrow.conformance.ops:op_check", (op,)) for op in KERNEL_OPS),
        *(Check("attention", f"paged[{shape}]", "sparrow.conformance.attention:attention_check", (shape,))
          for shape in ATTENTION_SHAPES),
        *(Check("engine", f"greedy_vs_hf[{arch}]", f"{engine}:greedy_vs_hf_check", (arch,)) for arch in TEST_MODELS),
        Check("engine", "seeded_sampling", f"{engine}:seeded_sampling_check"),
        Check("engine", "preemption", f"{engine}:preemption_check"),
        Check("engine", "kv_connector[shared_storage]", f"{engine}:kv_connector_check"),
    ]


def select_checks(only: str | Iterable[str] | None = None) -> list[Check]:
    """The checks ``only`` names: group names, ``group/name`` ids or shell patterns of either
    (``"engine/greedy*"``); every check when None. ValueError naming ``only`` when an item
    matches nothing."""
    checks = all_checks()
    if only is None:
        return checks
    items = [only] if isinstance(only, str) else list(only)
    patterns = [item.strip() for raw in items for item in str(raw).split(",") if item.strip()]
    if not patterns:
        raise ValueError("only must name at least one group or check")
    selected: list[Check] = []
    for pattern in patterns:
        matched = [c for c in checks
                   if fnmatch.fnmatchcase(c.group, pattern) or fnmatch.fnmatchcase(c.check_id, pattern)]
        if not matched:
            raise ValueError(f"only: {pattern!r} matches no check; groups: {', '.join(GROUPS)}; "
                             f"checks: {', '.join(c.check_id for c in checks)}")
        selected.extend(c for c in matched if c not in selected)
    return [c for c in checks if c in selected]  # in run order


def run_check(check: Check, ctx: Any) -> CheckResult:
    """Run one check; an exception is its failure, named in the detail."""
    try:
        status, detail = check(ctx)
    except Exception as exc:  # noqa: BLE001 - a platform's crash is a result to report
        return CheckResult(check.group, check.name, False, one_line(f"raised {type(exc).__name__}: {exc}"))
    ok = status != "FAIL"
    return CheckResult(check.group, check.name, ok, detail, status)  # type: ignore[arg-type]


def run_checks(device: str, *, model_dir: str | Path | None = None, dtype: str | None = None,
               only: str | Iterable[str] | None = None, on_result: ResultCallback | None = None) -> Report:
    """Run the conformance checks on platform ``device``; a :class:`Report` (a list of
    :class:`CheckResult`; ``report.ok``, ``report.table()``). ``on_result`` is called with each
    result as soon as it is known (the CLI prints rows as they come)."""
    from sparrow.conformance.context import ConformanceContext

    checks = select_checks(only)
    report = Report()
    with ConformanceContext(device, model_dir=model_dir, dtype=dtype) as ctx:
        for check in checks:
            result = run_check(check, ctx)
            report.append(result)
            if on_result is not None:
                on_result(result)
    return report
