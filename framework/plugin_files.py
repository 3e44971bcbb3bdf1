"""Plugins kept in a plain file rather than an installed package, for command-line flags such as
vLLM's ``sparrow serve --tool-parser-plugin FILE``: imported once per process and checked like an
entry point (``sparrow.plugins``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pluggy

from sparrow.plugins import PluginError, check_contract, get_plugin_manager, register_plugin


def load_plugin_file(path: str, flag: str, hook_name: str, pm: pluggy.PluginManager | None = None) -> None:
    """Register the Python file ``path`` as a plugin of ``pm`` (default: the process's), for a
    command-line flag such as ``--tool-parser-plugin``: a plugin that need not be installed. The
    file must implement ``hook_name``; it is imported once per process and checked like an entry
    point (its ``SPARROW_CONTRACT``, its hook names). ValueError naming ``flag`` when the file
    cannot be read or implements no ``hook_name``; PluginError when it fails to import."""
    pm = pm or get_plugin_manager()
    file = Path(path).expanduser().resolve()
    name = f"{flag.lstrip('-')}:{file}"
    if pm.get_plugin(name) is not None:
        return
    if not file.is_file():
        raise ValueError(f"{flag}: no such file: {path!r}")
    module_name = "sparrow_plugin_file_" + "".join(c if c.isalnum() else "_" for c in file.stem)
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure is reported with the file's name
        del sys.modules[module_name]
        raise PluginError(f"{flag} {path!r} failed to import: {exc!r}") from exc
    if not callable(getattr(module, hook_name, None)):
        raise ValueError(f"{flag}: {path!r} defines no {hook_name} hook implementation (a function decorated "
                         f"with sparrow.hookspecs.hookimpl)")
    check_contract(module, name)
    register_plugin(pm, module, name)



def load_reasoning_parser_plugin(path: str | None) -> None:
    """The ``reasoning_parser_plugin`` engine argument's file, loaded in this process (each engine
    process calls this before it looks ``reasoning_parser`` up); nothing when None."""
    if path is not None:
        load_plugin_file(path, "reasoning_parser_plugin", "sparrow_register_reasoning_parsers")
