"""Snapshot the hook contract, and judge a change of it against the contract version.

    python scripts/hookspec_snapshot.py            # rewrite tests/hookspecs_snapshot.json
    python scripts/hookspec_snapshot.py --check    # exit 1, saying why, when a bump or a rewrite is due

The snapshot records, for every hookspec of ``sparrow.hookspecs``: its parameters with their
annotations (as written), its return annotation and its pluggy flags, plus ``CONTRACT_VERSION``.
``tests/test_hook_contract.py`` compares it with the current specs: any difference needs a version
bump of the right size (see ``classify``), then a rewrite of the snapshot with this script.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT / "tests" / "hookspecs_snapshot.json"
RULE = ("bump CONTRACT_VERSION (minor for an added hook or argument, major for a removed/renamed one or a "
        "changed meaning) and regenerate with scripts/hookspec_snapshot.py")
MAJOR, MINOR = "major", "minor"


def _annotation(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    # The hookspecs module uses postponed annotations, so these are the source text already.
    return value if isinstance(value, str) else inspect.formatannotation(value)


def build_snapshot(module: ModuleType | None = None) -> dict[str, Any]:
    """The contract of ``module`` (default ``sparrow.hookspecs``) as plain JSON data."""
    if module is None:
        from sparrow import hookspecs as module
    marker = f"{module.PROJECT_NAME}_spec"  # where pluggy's HookspecMarker keeps a spec's options
    specs: dict[str, Any] = {}
    for name in sorted(dir(module)):
        function = getattr(module, name)
        options = getattr(function, marker, None)
        if not name.startswith("sparrow_") or options is None:
            continue
        signature = inspect.signature(function)
        specs[name] = {
            "parameters": [{"name": p.name, "annotation": _annotation(p.annotation)}
                           for p in signature.parameters.values()],
            "returns": _annotation(signature.return_annotation),
            "firstresult": bool(options.get("firstresult")),
            "historic": bool(options.get("historic")),
        }
    return {"contract_version": module.CONTRACT_VERSION, "hookspecs": specs}


def classify(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every difference between two snapshots' specs as ``(hook, level, what)``.

    Hooks are called with keywords and an implementation names only the arguments it uses, so an
    added hook or argument breaks no plugin (minor); a removed or renamed one does (major), and so
    does a changed flag (a collecting hook turned firstresult changes what every caller gets). A
    changed annotation refines the documented type (minor); a change of meaning that leaves the
    signature alone cannot be seen here, and is the author's to bump as major.
    """
    changes: list[tuple[str, str, str]] = []
    old_specs, new_specs = saved["hookspecs"], current["hookspecs"]
    for hook in sorted(set(old_specs) | set(new_specs)):
        old, new = old_specs.get(hook), new_specs.get(hook)
        if new is None:
            changes.append((hook, MAJOR, "removed"))
            continue
        if old is None:
            changes.append((hook, MINOR, "added"))
            continue
        old_params = {p["name"]: p["annotation"] for p in old["parameters"]}
        new_params = {p["name"]: p["annotation"] for p in new["parameters"]}
        for arg in old_params.keys() - new_params.keys():
            changes.append((hook, MAJOR, f"argument {arg!r} removed or renamed"))
        for arg in new_params.keys() - old_params.keys():
            changes.append((hook, MINOR, f"argument {arg!r} added"))
        for arg in sorted(old_params.keys() & new_params.keys()):
            if old_params[arg] != new_params[arg]:
                changes.append((hook, MINOR, f"annotation of {arg!r} changed from {old_params[arg]!r} "
                                             f"to {new_params[arg]!r}"))
        if old["returns"] != new["returns"]:
            changes.append((hook, MINOR, f"return annotation changed from {old['returns']!r} to {new['returns']!r}"))
        for flag in ("firstresult", "historic"):
            if old[flag] != new[flag]:
                changes.append((hook, MAJOR, f"{flag} changed from {old[flag]} to {new[flag]}"))
    return changes


def _bump(old: Version, new: Version) -> str:
    if new.major > old.major:
        return MAJOR
    if new.major == old.major and new.minor > old.minor:
        return MINOR
    return "patch" if new > old else "no"


def contract_errors(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Why the current specs and version do not match the snapshot; empty when they do."""
    return [message for _, message in _problems(saved, current)]


def _problems(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, str]]:
    """``(kind, message)``: kind "bump" when CONTRACT_VERSION must change, "stale" when only the
    snapshot is behind a right version."""
    errors = [("bump", message) for message in _bump_errors(saved, current)]
    if errors or saved == current:
        return errors
    # The bump is right (or nothing changed but the version); the snapshot must now record it,
    # or the next change would be judged against a stale base.
    changes = "; ".join(f"{hook} {what}" for hook, _, what in classify(saved, current)) or "no hookspec change"
    return [("stale", f"CONTRACT_VERSION is {current['contract_version']} and the snapshot records "
                      f"{saved['contract_version']} ({changes}): regenerate the snapshot with "
                      f"scripts/hookspec_snapshot.py")]


def _bump_errors(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    old_version, new_version = Version(saved["contract_version"]), Version(current["contract_version"])
    changes = classify(saved, current)
    if new_version < old_version:
        return [f"CONTRACT_VERSION {new_version} is older than the snapshot's {old_version}: versions only grow"]
    if not changes:
        return []
    if new_version == old_version:
        return [f"hookspec {hook} changed ({what}): {RULE}" for hook, _, what in changes]
    bump = _bump(old_version, new_version)
    errors = []
    for hook, level, what in changes:
        if level == MAJOR and bump != MAJOR:
            errors.append(f"hookspec {hook} changed ({what}), a major change, but CONTRACT_VERSION went from "
                          f"{old_version} to {new_version}, a {bump} bump: make it {old_version.major + 1}.0.0")
        elif level == MINOR and bump not in (MAJOR, MINOR):
            errors.append(f"hookspec {hook} changed ({what}), a minor change, but CONTRACT_VERSION went from "
                          f"{old_version} to {new_version}, a {bump} bump: make it at least "
                          f"{old_version.major}.{old_version.minor + 1}.0")
    return errors


def write(path: Path, snapshot: dict[str, Any]) -> None:
    path.write_text(json.dumps(snapshot, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=SNAPSHOT, help="the snapshot file (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="compare with the snapshot instead of writing it")
    parser.add_argument("--force", action="store_true",
                        help="record the specs even without the version bump they need (only for a contract "
                             "version never released, whose snapshot is still being settled)")
    args = parser.parse_args(argv)
    current = build_snapshot()
    if args.check:
        errors = contract_errors(json.loads(args.output.read_text(encoding="utf-8")), current)
        for error in errors:
            print(error, file=sys.stderr)
        return 1 if errors else 0
    if args.output.exists() and not args.force:
        # Refuse to record a change whose version bump is missing or too small: the snapshot is
        # what the next change is judged against.
        saved = json.loads(args.output.read_text(encoding="utf-8"))
        errors = [message for kind, message in _problems(saved, current) if kind == "bump"]
        if errors:
            for error in errors:
                print(error, file=sys.stderr)
            print("(--force records them anyway, for a contract version that was never released)", file=sys.stderr)
            return 1
    write(args.output, current)
    print(f"wrote {args.output} ({len(current['hookspecs'])} hookspecs, contract {current['contract_version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
