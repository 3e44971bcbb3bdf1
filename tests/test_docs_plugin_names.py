"""Every public name docs/plugins.md mentions can be imported: the vendor's guide never points at a
module, class or function that moved or was renamed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
# `sparrow.ops.OpImpl`, `sparrow_cpu.attention:TorchPagedAttention`, `sparrow.hookspecs.CONTRACT_VERSION`...
NAME = re.compile(r"`((?:sparrow|sparrow_cpu|sparrow_cuda|sparrow_schedulers)(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?)")


def mentioned_names() -> list[str]:
    return sorted(set(NAME.findall(DOC.read_text(encoding="utf-8"))))


def resolve(name: str) -> object:
    """Import the longest module prefix of ``name`` and look the rest up as attributes."""
    dotted = name.replace(":", ".")
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the docs name something that does not exist
        return obj
    raise ModuleNotFoundError(name)


def test_the_guide_names_public_objects() -> None:
    assert len(mentioned_names()) >= 10, "docs/plugins.md should name the classes and modules a vendor uses"


@pytest.mark.parametrize("name", mentioned_names())
def test_every_name_in_the_plugin_guide_imports(name: str) -> None:
    try:
        resolve(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"docs/plugins.md mentions `{name}`, which does not import: {exc!r}")
