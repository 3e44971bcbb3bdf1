"""Where a benchmark writes its report, checked before the benchmark runs: a run of minutes must
not end on a path it cannot write.

One rule for every ``sparrow bench`` output (``--result-file``, ``--output-dir``, ``bench trace
--output``): the output's parent directory is created when it is missing only if it lies inside
the working directory (``bench-results/...``); elsewhere it must exist already (a typo in an
absolute path is refused, not created). An output directory itself is created like ``mkdir``.
Either way, the place must be writable, which is tried by creating a file there and removing it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

# Flag dest -> (flag as the user types it, whether the value names a directory). A value of ''
# means "write no report" where a command allows it.
OUTPUTS = {
    "result_file": ("--result-file", False),
    "output_dir": ("--output-dir", True),
    "output": ("--output", False),
}
# The sentence the commands' --help carries, so that help and check agree.
RULE = "a missing parent directory is created only inside the working directory; checked before the run"


def check_outputs(args: argparse.Namespace) -> None:
    """Check every output path ``args`` carries (see OUTPUTS); ValueError naming the flag."""
    for dest, (flag, is_dir) in OUTPUTS.items():
        path = getattr(args, dest, None)
        if isinstance(path, str) and path:
            check_output_path(flag, path, is_dir=is_dir)


def check_output_path(flag: str, path: str, *, is_dir: bool) -> None:
    """Raise ValueError, naming ``flag``, unless ``path`` (a file, or a directory when ``is_dir``)
    can be written under the rule above. Creates nothing that outlives the check."""
    target = Path.cwd() / path  # an absolute path stays as it is
    if is_dir and target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    if not is_dir and target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name")
    parent = target.parent
    if not parent.is_dir() and not parent.resolve().is_relative_to(Path.cwd().resolve()):
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist (only directories inside the "
                         "working directory are created); create it first")
    start = target if is_dir else parent
    existing = next(folder for folder in (start, *start.parents) if folder.exists())  # "/" always exists
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is not a directory")
    try:
        if target.is_file():
            with target.open("a"):  # the file itself must be writable, not just its directory
                pass
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".sparrow-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None
