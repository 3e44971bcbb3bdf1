"""The conformance suite as a pytest plugin, for a platform vendor's own CI::

    pytest -p sparrow.conformance.pytest_plugin --sparrow-device=npu

adds one test per conformance check, with ids ``sparrow-conformance[npu]::ops/rms_norm``,
``...::attention/paged[gqa, d64]``, ``...::engine/greedy_vs_hf[qwen3]`` and so on, to whatever else
the run collects (run it from an empty directory, or with ``-k sparrow-conformance``, to run only
the suite). A failing check fails its test with the check's detail (which op case, which token);
a check the platform does not apply to (no KV connector registered) is skipped; an op served by
the torch reference passes. Options:

- ``--sparrow-device=NAME``: the platform to check (required to add the tests);
- ``--sparrow-dtype=DTYPE``: dtype of the op and attention checks (default: the platform's);
- ``--sparrow-only=CHECK[,CHECK...]``: groups (ops, attention, engine), ``group/name`` ids or shell
  patterns, as ``sparrow plugins --check --only`` takes;
- ``--sparrow-model-dir=DIR``: where the engine checks build their tiny models (cache it between CI
  runs; default: a temporary directory removed at the end of the session).

Without ``--sparrow-device`` the plugin adds nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from sparrow.conformance import Check, run_check, select_checks

SUITE = "sparrow-conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sparrow", "Sparrow platform conformance suite")
    group.addoption("--sparrow-device", default=None, metavar="NAME",
                    help="run Sparrow's conformance checks on platform NAME, one test per check")
    group.addoption("--sparrow-dtype", default=None, metavar="DTYPE",
                    help="dtype of the op and attention checks (default: the platform's default dtype)")
    group.addoption("--sparrow-only", default=None, metavar="CHECKS",
                    help="comma-separated groups, group/name ids or patterns of the checks to run (default: all)")
    group.addoption("--sparrow-model-dir", default=None, metavar="DIR",
                    help="where the engine checks build (and reuse) their test models (default: a temporary dir)")


class ConformanceFailure(Exception):
    """A check failed; the message is its detail."""


class ConformanceSession:
    """The run's shared context, built by the first check that runs and closed at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._ctx: Any = None

    def context(self) -> Any:
        if self._ctx is None:
            from sparrow.conformance.context import ConformanceContext

            option = self.config.getoption
            self._ctx = ConformanceContext(option("sparrow_device"), model_dir=option("sparrow_model_dir"),
                                           dtype=option("sparrow_dtype"))
        return self._ctx

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None


class ConformanceItem(pytest.Item):
    def __init__(self, *, check: Check, session_state: ConformanceSession, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.session_state = session_state

    def runtest(self) -> None:
        result = run_check(self.check, self.session_state.context())
        if result.status == "skip":
            pytest.skip(result.detail)
        if not result.ok:
            raise ConformanceFailure(result.detail)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, ConformanceFailure):
            return f"{self.check.check_id} failed: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"{SUITE}::{self.check.check_id}"


class ConformanceSuite(pytest.Collector):
    def __init__(self, *, session_state: ConformanceSession, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.session_state = session_state

    def collect(self) -> list[pytest.Item]:
        only = self.config.getoption("sparrow_only")
        try:
            checks = select_checks(only)
        except ValueError as exc:
            raise pytest.UsageError(f"--sparrow-only: {exc}") from None
        return [ConformanceItem.from_parent(self, name=check.check_id, check=check,
                                            session_state=self.session_state) for check in checks]


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so that they apply to these tests too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    device = config.getoption("sparrow_device")
    if not device:
        return
    from sparrow.platforms import resolve_platform

    try:
        resolve_platform(device)  # an unknown device is the command line's mistake, not 16 failures
    except (ValueError, RuntimeError) as exc:
        raise pytest.UsageError(f"--sparrow-device: {exc}") from None
    state = ConformanceSession(config)
    config.add_cleanup(state.close)
    suite = ConformanceSuite.from_parent(session, name=f"{SUITE}[{device}]", nodeid=f"{SUITE}[{device}]",
                                         session_state=state)
    collected = suite.collect()
    # Reported like any collection, so that the terminal's counts ("16 items / 14 deselected") add up.
    result: list[pytest.Item | pytest.Collector] = [*collected]
    session.ihook.pytest_collectreport(report=pytest.CollectReport(suite.nodeid, "passed", None, result))
    items.extend(collected)
