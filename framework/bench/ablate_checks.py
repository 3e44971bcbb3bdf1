"""The checks `sparrow bench ablate` runs before its first point: a grid runs for minutes, so a
mistake anywhere in it (the last scheduler of a list, a block size no engine takes, a device that
is not there) must fail before any point has run, in one line naming the flag.

Each point's engine configuration is built and pre-flighted the way the engine itself does at
start-up (``finalize_config``; ``sim_engine_config`` on the simulated device), which loads no
model and starts no process.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Raises ConfigError (a ValueError) for a point, engine arguments -> value, that no engine would take.
PointCheck = Callable[[dict[str, Any]], None]


def parse_engine_args(text: str) -> dict[str, Any]:
    """``--engine-args``: a JSON object of engine arguments besides those with flags of their own."""
    try:
        engine_args = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--engine-args is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(engine_args, dict):
        raise ValueError(f"--engine-args must be a JSON object, got {text!r}")
    for name, flag in (("model", "MODEL"), ("seed", "--seed")):
        if name in engine_args:
            raise ValueError(f"--engine-args sets {name}; use {flag}")
    return engine_args


def check_flags(args: argparse.Namespace) -> None:
    """The flags that are not grid values; ValueError naming the flag."""
    if not (math.isfinite(args.length_scale) and args.length_scale > 0):
        raise ValueError(f"--length-scale must be a number > 0, got {args.length_scale}")
    if args.trace is not None:
        if not Path(args.trace).is_file():
            raise ValueError(f"--trace {args.trace}: no such file")
        if args.length_scale != 1.0:
            raise ValueError("--length-scale scales the built-in workloads; a --trace is replayed as written")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.schedulers != ["all"] and "all" in args.schedulers:
        raise ValueError(f"--schedulers: 'all' names every scheduler and goes alone, got {','.join(args.schedulers)}")


def resolve_device(args: argparse.Namespace, engine_args: dict[str, Any]) -> str | None:
    """The device of every point (None: the engine's default), set into ``engine_args`` (left out
    for ``sim``, which runs in this process) and checked to be here; ValueError naming the flag."""
    device = args.device
    if device is not None and engine_args.get("device", device) != device:
        raise ValueError(f"--device {device} and --engine-args device {engine_args['device']!r} disagree")
    device = device or engine_args.get("device")
    if device == "sim":
        engine_args.pop("device", None)
        from sparrow.sim.platform import sim_settings

        try:
            sim_settings({"sim_gpu": args.sim_gpu or "h100"})
        except ValueError as exc:
            raise ValueError(f"--sim-gpu {args.sim_gpu}: {exc}") from None
    elif args.sim_gpu is not None:
        raise ValueError("--sim-gpu needs --device sim")
    elif device is not None:
        engine_args["device"] = device
        from sparrow.engine.preflight import resolve_configured_platform

        try:
            resolve_configured_platform(device)
        except ValueError as exc:
            raise ValueError(f"{'--device' if args.device else '--engine-args device'} {device}: {exc}") from None
    return device


def engine_point_check(model_path: str, engine_args: dict[str, Any], seed: int,
                       sim_gpu: str | None) -> PointCheck:
    """The check of this run's points: their engines' configurations, built as the engine builds them."""
    from sparrow.config import EngineConfig
    from sparrow.engine.setup import finalize_config

    def check(point: dict[str, Any]) -> None:
        kwargs = {**engine_args, **point}
        if sim_gpu is not None:
            from sparrow.sim.driver import sim_engine_config

            sim_engine_config(model_path, sim_gpu=sim_gpu, seed=seed, **kwargs)
            return
        kwargs.pop("multiprocess", None)  # an LLM() argument, not an engine one
        finalize_config(EngineConfig.from_kwargs(model=model_path, seed=seed, **kwargs))

    return check


def check_grid(axes: dict[str, list[Any] | None], flags: dict[str, str], points: list[dict[str, Any]],
               check_point: PointCheck, label: Callable[[dict[str, Any]], str]) -> None:
    """The settings every point shares (``--engine-args``), every grid value alone (so that the
    message names its flag), then every combination; ValueError naming the flag or the point.
    ``flags``: engine argument -> its grid flag; ``label``: a point's name in the table."""
    try:
        check_point({})
    except ValueError as exc:
        raise ValueError(f"--engine-args: {exc}") from None
    for arg, values in axes.items():
        for value in values or ():
            try:
                check_point({arg: value})
            except ValueError as exc:
                shown = ("on" if value else "off") if isinstance(value, bool) else value
                raise ValueError(f"{flags[arg]} {shown}: {exc}") from None
    for point in points:
        try:
            check_point(point)
        except ValueError as exc:
            raise ValueError(f"grid point {label(point)!r}: {exc}") from None
