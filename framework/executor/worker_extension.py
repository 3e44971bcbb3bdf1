"""vLLM's ``worker_extension_cls``: methods of the user's class added to every worker.

RLHF and research code (OpenRLHF, verl, ...) write a small class whose methods run on each worker
(``self`` is the worker: ``self.model_runner.model``, ``self.device``, ``self.rank``), pass its
import path as ``worker_extension_cls``, and call the methods by name with
``collective_rpc("method_name", args=...)``. Each worker process builds its worker as a subclass of
the platform's worker class and the extension; the pre-flight imports the class first and refuses
one that would replace anything of the worker's, so that the engine's own methods never change.
"""

from __future__ import annotations

from typing import Any

from sparrow.plugins import import_object


def import_extension(path: str) -> type:
    """The class named ``"package.module:Class"`` (or vLLM's ``"package.module.Class"``)."""
    if ":" not in path:
        module, _, name = path.rpartition(".")
        path = f"{module}:{name}" if module else path
    extension = import_object(path)
    if not isinstance(extension, type):
        raise TypeError(f"{path!r} is a {type(extension).__name__}, not a class")
    return extension


def conflicts(worker_cls: type, extension: type) -> list[str]:
    """The extension's attributes that the worker class already has (and ``__init__``: an
    extension adds methods, it does not build the worker)."""
    own = [name for name in vars(extension) if not (name.startswith("__") and name.endswith("__"))]
    clashes = [name for name in own if hasattr(worker_cls, name)]
    if "__init__" in vars(extension):
        clashes.append("__init__")
    return sorted(clashes)


def check_worker_extension(path: str, worker_cls_path: str) -> None:
    """ValueError saying why ``path`` cannot extend the worker class ``worker_cls_path``."""
    try:
        extension = import_extension(path)
    except (ImportError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    clashes = conflicts(import_object(worker_cls_path), extension)
    if clashes:
        raise ValueError(f"{extension.__name__} defines {', '.join(clashes)}, which the worker "
                         f"({worker_cls_path}) already has; an extension may only add methods")


def worker_class(worker_cls_path: str, config: Any) -> type:
    """The platform's worker class, with ``config``'s worker extension mixed in when there is one."""
    worker_cls = import_object(worker_cls_path)
    path = config.parallel.worker_extension_cls
    if not path:
        return worker_cls
    extension = import_extension(path)
    return type(f"{worker_cls.__name__}With{extension.__name__}", (worker_cls, extension), {})
