"""Running a conformance case: a platform's implementation and the torch reference on the same
inputs, outputs compared within tolerances that suit the dtype. The conformance suite
(``sparrow plugins --check``) and the kernel's own tests call :func:`run_case`."""

from __future__ import annotations

from typing import Any

import torch

from sparrow.ops.cases import OpCase, describe_value


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, torch.Generator):
        copy = torch.Generator(device=value.device)
        copy.set_state(value.get_state())
        return copy
    return value


def _clone_args(case: OpCase) -> tuple[tuple, dict]:
    return tuple(_clone(a) for a in case.args), {k: _clone(v) for k, v in case.kwargs.items()}


def compare_outputs(case: OpCase, expected: Any, got: Any) -> tuple[bool, str]:
    """Every output tensor (a tuple's too) of ``got`` against ``expected`` under ``case``'s rule."""
    if case.compare is not None:
        return case.compare(expected, got, case.args)
    expected_parts = expected if isinstance(expected, tuple) else (expected,)
    got_parts = got if isinstance(got, tuple) else (got,)
    if len(expected_parts) != len(got_parts):
        return False, f"returned {len(got_parts)} outputs, the reference {len(expected_parts)}"
    worst = 0.0
    for index, (want, have) in enumerate(zip(expected_parts, got_parts)):
        where = f"output {index}: " if len(expected_parts) > 1 else ""
        if not isinstance(have, torch.Tensor):
            return False, f"{where}expected a tensor, got {describe_value(have)}"
        if have.shape != want.shape or have.dtype != want.dtype:
            return False, f"{where}expected {describe_value(want)}, got {describe_value(have)}"
        if have.device != want.device:
            return False, f"{where}on {have.device}, the reference on {want.device}"
        if case.exact:
            if not torch.equal(have, want):
                differing = int((have != want).sum())
                return False, f"{where}{differing} of {want.numel()} elements differ (exact comparison)"
            continue
        try:
            torch.testing.assert_close(have, want, atol=case.atol, rtol=case.rtol, equal_nan=True)
        except AssertionError:
            err = _max_abs_err(want, have)
            return False, f"{where}max abs err {err:.3g} (atol {case.atol:g}, rtol {case.rtol:g})"
        worst = max(worst, _max_abs_err(want, have))
    return True, "exact" if case.exact else f"max abs err {worst:.2g}"


def _max_abs_err(want: torch.Tensor, have: torch.Tensor) -> float:
    want64, have64 = want.double(), have.double()
    finite = torch.isfinite(want64) & torch.isfinite(have64)
    if not bool(finite.all()) and not torch.equal(torch.isfinite(want64), torch.isfinite(have64)):
        return float("inf")
    return float((want64 - have64).abs()[finite].max()) if bool(finite.any()) else 0.0


def run_case(case: OpCase, impl: Any) -> tuple[bool, str]:
    """Run ``impl`` on ``case`` and compare with the torch reference: ``(ok, detail)``.

    ``impl``: an :class:`~sparrow.ops.OpImpl` subclass for a layer op, a function for a function
    op, or None for the reference itself. A layer ``impl.supports`` declines passes with a detail
    that says so (the reference serves such layers). An exception is a failure, named in the detail.
    """
    from sparrow.ops import KERNEL_OPS

    spec = KERNEL_OPS[case.op]
    try:
        with torch.inference_mode():  # as the engine runs its steps
            return _run(case, spec, impl)
    except Exception as exc:  # noqa: BLE001 - a failing kernel is a result to report, not a crash
        return False, f"raised {type(exc).__name__}: {exc}"


def _run(case: OpCase, spec: Any, impl: Any) -> tuple[bool, str]:
    from sparrow.plugins import import_object

    if spec.kind == "layer":
        if case.make_layer is None:
            raise ValueError(f"case {case.label!r} of layer op {case.op!r} has no make_layer")
        args, kwargs = _clone_args(case)
        expected = case.make_layer().forward_native(*args, **kwargs)
        layer = case.make_layer()
        if impl is None:
            call = layer.forward_native
        else:
            if not impl.supports(layer):
                return True, "not supported by this implementation: the reference serves it"
            call = impl(layer)
            call.process_weights()
    else:
        reference = import_object(spec.reference)
        args, kwargs = _clone_args(case)
        expected = reference(*args, **kwargs)
        call = reference if impl is None else impl
    args, kwargs = _clone_args(case)
    got = call(*args, **kwargs)
    return compare_outputs(case, expected, got)


def op_cases(op: str, dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    """The cases ``KERNEL_OPS[op]`` names (an empty list when it names none)."""
    from sparrow.ops import KERNEL_OPS
    from sparrow.plugins import import_object

    spec = KERNEL_OPS[op]
    return [] if spec.cases is None else import_object(spec.cases)(dtype, torch.device(device))
