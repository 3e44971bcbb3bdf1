"""Built-in model architectures, registered through the same hook a plugin uses.

The kernel registers this module as a plugin (``sparrow.plugins.KERNEL_PLUGINS``). Classes are
named by import path and imported only when a model of that architecture is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from sparrow.hookspecs import hookimpl
from sparrow.plugins import import_object

# config.json architecture name -> "module:Class"
BUILTIN_ARCHITECTURES: tuple[tuple[str, str], ...] = (
    ("LlamaForCausalLM", "sparrow.models.llama:LlamaForCausalLM"),
    ("MistralForCausalLM", "sparrow.models.llama:LlamaForCausalLM"),
    ("Qwen2ForCausalLM", "sparrow.models.qwen2:Qwen2ForCausalLM"),
    ("Qwen3ForCausalLM", "sparrow.models.qwen3:Qwen3ForCausalLM"),
    ("Gemma2ForCausalLM", "sparrow.models.gemma2:Gemma2ForCausalLM"),
    ("Gemma3ForCausalLM", "sparrow.models.gemma3:Gemma3ForCausalLM"),
    ("Phi3ForCausalLM", "sparrow.models.phi3:Phi3ForCausalLM"),
    ("Qwen3MoeForCausalLM", "sparrow.models.qwen3_moe:Qwen3MoeForCausalLM"),
    ("MixtralForCausalLM", "sparrow.models.mixtral:MixtralForCausalLM"),
)


class UnsupportedArchitectureError(ValueError):
    """No registered architecture matches the config's ``architectures``."""


@hookimpl
def sparrow_register_model_architectures(register: Callable[..., None]) -> None:
    for architecture, import_path in BUILTIN_ARCHITECTURES:
        register(architecture, import_path)


def _model_class(entry: Any) -> type:
    """A registered architecture's class: an import path, or a class (``ModelRegistry`` in this process)."""
    if not isinstance(entry, str):
        return entry
    from sparrow.model_registry import IN_PROCESS_ONLY

    if entry.startswith(IN_PROCESS_ONLY):
        raise UnsupportedArchitectureError(
            f"{entry.removeprefix(IN_PROCESS_ONLY)} was given to ModelRegistry.register_model as a class defined "
            "in the main script (or inside a function), which the engine's own process cannot import: define it "
            "in a module and register it by class or as 'package.module:Class', or run the engine in this "
            "process (LLM(..., multiprocess=False))")
    return import_object(entry)


def registered_architecture(hf_config: Any, registry_architectures: Mapping[str, Any]) -> str | None:
    """The registered architecture that serves ``hf_config``: the first of its ``architectures``
    that is registered. An encoder saved without its LM head (``Qwen3Model``, what ``AutoModel``
    saves; an embedding model) and a sequence or token classifier (``Qwen3ForSequenceClassification``)
    run on their ``*ForCausalLM`` class, whose LM head a pooling model leaves unused (the model
    loader adds a classifier's ``score`` layer). None when nothing registered serves it."""
    for architecture in list(getattr(hf_config, "architectures", None) or []):
        if architecture in registry_architectures:
            return architecture
        for suffix in ("ForSequenceClassification", "ForTokenClassification", "Model"):
            if not architecture.endswith(suffix):
                continue
            base = architecture.removesuffix(suffix)
            # Gemma 3's text-only classes are Gemma3Text*, its causal LM Gemma3ForCausalLM.
            for causal_lm in (base + "ForCausalLM", base.removesuffix("Text") + "ForCausalLM"):
                if causal_lm in registry_architectures:
                    return causal_lm
    return None


def unsupported_message(hf_config: Any, registry_architectures: Mapping[str, Any]) -> str:
    return (f"config.json architectures {list(getattr(hf_config, 'architectures', None) or [])} are not "
            f"supported; supported architectures: {', '.join(sorted(registry_architectures))} (a plugin or "
            "sparrow.ModelRegistry.register_model adds more)")


def resolve_model_class(hf_config: Any, registry_architectures: Mapping[str, Any]) -> type:
    """The model class that serves ``hf_config`` (:func:`registered_architecture`)."""
    architecture = registered_architecture(hf_config, registry_architectures)
    if architecture is None:
        raise UnsupportedArchitectureError(unsupported_message(hf_config, registry_architectures))
    return _model_class(registry_architectures[architecture])
