"""The op checks: every kernel op the platform registered an implementation for, on every case of
:mod:`sparrow.ops.cases`, against the op's torch reference (``forward_native`` or the reference
function), in the platform's dtype on the platform's device."""

from __future__ import annotations

from typing import Any


def op_check(ctx: Any, op: str) -> tuple[str, str]:
    """(status, detail) of ``op`` on the platform under test; "native" when nothing is registered."""
    from sparrow.ops import KERNEL_OPS
    from sparrow.ops.binding import impl_name, lookup_impl
    from sparrow.ops.check import op_cases, run_case

    registry = ctx.registry()
    entry = registry.ops.get(op, {}).get(ctx.platform.name)
    if entry is None:
        return "native", "no implementation registered: the torch reference serves it"
    try:
        impl = lookup_impl(op, ctx.platform.name, registry)
    except Exception as exc:  # noqa: BLE001 - an implementation that cannot load is this check's failure
        return "FAIL", f"{entry} could not be imported: {type(exc).__name__}: {exc}"
    name = entry if isinstance(entry, str) else impl_name(impl)
    cases = op_cases(op, ctx.torch_dtype, ctx.torch_device)
    if not cases:
        return "FAIL", f"{name}: op {op!r} has no conformance cases ({KERNEL_OPS[op].cases!r})"
    failures, declined, details = [], 0, []
    for case in cases:
        ok, detail = run_case(case, impl)
        if not ok:
            failures.append(f"case '{case.label}': {detail}")
        elif detail.startswith("not supported"):
            declined += 1
        else:
            details.append(detail)
    if failures:
        more = f" (and {len(failures) - 1} more failing cases)" if len(failures) > 1 else ""
        return "FAIL", f"{name}: {failures[0]}{more}"
    served = len(cases) - declined
    if served == 0:
        return "native", (f"{name} declines every {ctx.dtype} case (supports() is False): the torch reference "
                          f"serves them")
    declined_note = f", {declined} declined (the reference serves them)" if declined else ""
    error = worst(details)
    return "pass", f"{name}: {served} cases{', max abs err ' + error if error else ''}{declined_note}, {ctx.dtype}"


def worst(details: list[str]) -> str:
    """The largest "max abs err X" among case details, formatted; "" when no case reports one."""
    errors = []
    for detail in details:
        if detail.startswith("max abs err "):
            try:
                errors.append(float(detail.split()[3]))
            except (IndexError, ValueError):
                continue
    return f"{max(errors):.1e}" if errors else ""
