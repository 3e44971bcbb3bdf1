"""vLLM's ``ModelRegistry``: register a model architecture from a script, without a plugin.

    from sparrow import LLM, ModelRegistry
    ModelRegistry.register_model("MyLlamaForCausalLM", "my_package.model:MyLlamaForCausalLM")
    llm = LLM("/path/to/checkpoint")  # its config.json names MyLlamaForCausalLM

The engine core and tensor-parallel ranks run in processes of their own (``sparrow.engine.launch``),
which import plugins but never the user's script. A registration made here reaches them through
the environment: ``SPARROW_MODEL_ARCHITECTURES``, a JSON object of architecture -> import path,
which child processes inherit. So the class must be importable by its path, as a plugin's is:
defined in a module (a file beside the script will do: children share the script's ``sys.path``
and working directory). A class defined in the script itself (``__main__``) or inside a function
serves only an engine in this process (``LLM(..., multiprocess=False)``); an engine in its own
process fails at start-up with an error saying so. Registrations override plugins' and built-in
ones (with a warning), as in vLLM.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

ENV_ARCHITECTURES = "SPARROW_MODEL_ARCHITECTURES"
IN_PROCESS_ONLY = "in-process-only:"  # the import path children get for a class they cannot import
_classes: dict[str, type] = {}  # architecture -> class, registered in this process


def _registered_paths() -> dict[str, str]:
    try:
        paths = json.loads(os.environ.get(ENV_ARCHITECTURES) or "{}")
    except ValueError as exc:
        raise ValueError(f"${ENV_ARCHITECTURES} must be a JSON object of architecture -> 'module:Class': "
                         f"{exc}") from None
    if not isinstance(paths, dict) or not all(isinstance(v, str) for v in paths.values()):
        raise ValueError(f"${ENV_ARCHITECTURES} must be a JSON object of architecture -> 'module:Class'")
    return paths


def runtime_architectures() -> dict[str, Any]:
    """Architectures registered with ``ModelRegistry``: import paths, or classes in the process
    that registered them."""
    return {**_registered_paths(), **_classes}


class ModelRegistry:
    """vLLM's ``vllm.ModelRegistry`` (see the module docstring)."""

    @staticmethod
    def register_model(model_arch: str, model_cls: type | str) -> None:
        """Serve checkpoints whose ``config.json`` ``architectures`` names ``model_arch`` with
        ``model_cls``: a class, or its import path ``"package.module:Class"``."""
        if not isinstance(model_arch, str) or not model_arch:
            raise ValueError(f"model_arch must be a non-empty string, got {model_arch!r}")
        if isinstance(model_cls, str):
            module, _, name = model_cls.partition(":")
            if not module or not name:
                raise ValueError(f"model_cls must be a class or an import path 'package.module:Class', got "
                                 f"{model_cls!r}")
            path = model_cls
        elif isinstance(model_cls, type):
            path = f"{model_cls.__module__}:{model_cls.__qualname__}"
            if model_cls.__module__ == "__main__" or "<locals>" in model_cls.__qualname__:
                path = IN_PROCESS_ONLY + path
        else:
            raise ValueError(f"model_cls must be a class or an import path 'package.module:Class', got "
                             f"{type(model_cls).__name__}")
        if model_arch in ModelRegistry.get_supported_archs():
            logger.warning("model architecture %s is already registered; %s replaces it", model_arch, path)
        paths = _registered_paths()
        paths[model_arch] = path
        os.environ[ENV_ARCHITECTURES] = json.dumps(paths)
        if isinstance(model_cls, type):
            _classes[model_arch] = model_cls
        else:
            _classes.pop(model_arch, None)

    @staticmethod
    def get_supported_archs() -> list[str]:
        """Every architecture the engine can load: built-in, plugins' and registered here."""
        from sparrow.plugins import get_registry

        return sorted({*get_registry().architectures, *runtime_architectures()})
