"""``sparrow plugins``' op table and ``sparrow plugins --check DEVICE``."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from sparrow.conformance.report import table_header, table_row


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("conformance suite (sparrow plugins --check DEVICE)")
    group.add_argument("--check", metavar="DEVICE", default=None,
                       help="run the conformance suite on platform DEVICE (ops, attention, engine), print a table "
                            "of results and exit 1 if any check fails")
    group.add_argument("--dtype", default=None,
                       help="dtype of the op and attention checks (default: the platform's default dtype)")
    group.add_argument("--only", action="append", default=None, metavar="CHECK",
                       help="run only these checks: a group (ops, attention, engine), a group/name id or a shell "
                            "pattern such as 'engine/greedy*'; repeat or separate with commas (default: all)")
    group.add_argument("--model-dir", default=None, metavar="DIR",
                       help="directory where the engine checks build their tiny test models and reuse them on the "
                            "next run (default: a temporary directory, removed afterwards)")


def refuse_check_flags(args: argparse.Namespace) -> None:
    """ValueError when a flag of the suite is given without ``--check``."""
    for flag in ("dtype", "only", "model_dir"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} applies only with --check DEVICE")


def run_check_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the suite as the flags say; print rows as results come. 0 when every check passed."""
    from sparrow.conformance import run_checks, select_checks
    from sparrow.platforms import resolve_platform

    out = out or sys.stdout
    # Mistakes (an unknown check, device or dtype) fail before the table starts.
    select_checks(args.only)
    try:
        platform = resolve_platform(args.check)
    except RuntimeError as exc:  # the plugin is installed but found no device: say so in one line
        raise ValueError(str(exc)) from None
    dtype = platform.resolve_dtype(args.dtype or "auto")
    print(f"conformance of platform {platform.name!r} ({type(platform).__name__}), {dtype} on "
          f"{platform.device_for_rank(0)}:", file=out)
    print(table_header(), file=out, flush=True)

    def show(result: Any) -> None:
        print(table_row(result), file=out, flush=True)

    report = run_checks(args.check, model_dir=args.model_dir, dtype=args.dtype, only=args.only, on_result=show)
    print(report.summary(), file=out)
    for failure in report.failures:
        print(f"FAILED {failure.check_id}: {failure.detail}", file=out)
    return 0 if report.ok else 1


def print_op_table(registry: Any, platforms: list[str], out: TextIO | None = None) -> None:
    """Which implementation serves each kernel op on each registered platform."""
    from sparrow.ops import ATTENTION_OP
    from sparrow.ops.binding import op_table

    out = out or sys.stdout
    rows = [(op, [per_platform[p] for p in platforms]) for op, per_platform in op_table(platforms, registry)]
    widths = [max(len("op"), len(ATTENTION_OP), *(len(op) for op, _ in rows))]
    for column, platform in enumerate(platforms):
        widths.append(max(len(platform), *(len(cells[column]) for _, cells in rows)))
    print("ops (native = the torch reference):", file=out)
    for cells in (["op", *platforms], *([op, *impls] for op, impls in rows)):
        print("  " + "  ".join(f"{cell:<{width}}" for cell, width in zip(cells, widths)).rstrip(), file=out)
    print(f"  {ATTENTION_OP:<{widths[0]}}  via sparrow_attention_backend", file=out)
