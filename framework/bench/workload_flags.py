"""The prompt and output length flags the random workloads share (``bench throughput``, ``bench
serve``): a range (``--input-len-min``/``--input-len-max``, the same for outputs), or vLLM's fixed
length flag, optionally widened by a ratio. ValueError naming the flag for every mistake."""

from __future__ import annotations

import argparse


def resolve_lengths(args: argparse.Namespace, kind: str, fixed: int | None, fixed_flag: str,
                    defaults: dict[str, int], ratio: float = 0.0) -> None:
    """Set ``args.{kind}_len_min`` / ``_max`` (kind: input or output): from ``fixed`` (the value of
    ``fixed_flag``; lengths uniform in [fixed * (1 - ratio), fixed * (1 + ratio)], both ends in), else
    from the range flags, else from ``defaults``."""
    low_name, high_name = f"{kind}_len_min", f"{kind}_len_max"
    if fixed is not None:
        if getattr(args, low_name) is not None or getattr(args, high_name) is not None:
            raise ValueError(f"{fixed_flag} sets the lengths: give it or --{kind}-len-min/--{kind}-len-max, "
                             "not both")
        if fixed < 1:
            raise ValueError(f"{fixed_flag} must be at least 1, got {fixed}")
        setattr(args, low_name, max(1, int(fixed * (1 - ratio))))
        setattr(args, high_name, int(fixed * (1 + ratio)) + 1)
    for name in (low_name, high_name):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])


def check_length_ranges(args: argparse.Namespace) -> None:
    """Both ranges non-empty and starting at 1 or more."""
    for kind in ("input", "output"):
        low, high = getattr(args, f"{kind}_len_min"), getattr(args, f"{kind}_len_max")
        if low < 1:
            raise ValueError(f"--{kind}-len-min must be at least 1, got {low}")
        if high <= low:
            raise ValueError(f"--{kind}-len-max ({high}) must be greater than --{kind}-len-min ({low})")
