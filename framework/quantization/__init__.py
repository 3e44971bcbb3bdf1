"""Quantization methods: how a model's weights are stored and multiplied in fewer bits.

A method is a :class:`QuantizationMethod` registered by name through
``sparrow_register_quantization_methods`` and chosen with the ``quantization`` engine argument
(vLLM's name). It does not build layers of its own: it serves registered ops (``linear``,
``embedding``...) with :class:`sparrow.ops.OpImpl` classes, which the worker binds in place of the
platform's (``sparrow.ops.bind_ops(model, platform, overrides=op_overrides_for(config, platform))``).
An OpImpl's ``process_weights`` runs once after the checkpoint loads and may quantize the layer's
weights there (``layer.replace_parameter``)::

    class Int4Linear(OpImpl):
        name = "int4_linear"
        def process_weights(self):
            ...  # pack self.layer.weight
        def __call__(self, x):
            ...

    class Int4(QuantizationMethod):
        name = "int4"
        def op_overrides(self, platform):
            return {"linear": Int4Linear}

    @hookimpl
    def sparrow_register_quantization_methods(register):
        register("int4", Int4)

A method may also decide how the linear layers hold their weights while the model is built
(``linear_weights``: int4 ``qweight``/``qzeros``/``scales`` loaded from an AWQ or GPTQ checkpoint,
fp8 weights with their scales): the worker builds the model inside :func:`quantization_scope`,
and every :class:`sparrow.layers.linear.LinearBase` asks :func:`linear_weights_for` when created.

The built-in methods (``int8``, ``fp8``, ``awq``, ``gptq``, registered in
``sparrow.kernel_components`` through the same hook) are in this package's modules. A checkpoint
whose config.json has a ``quantization_config`` selects its method by itself
(:func:`resolve_quantization`, as vLLM does).

Importing this package is cheap (no torch).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

if TYPE_CHECKING:
    from sparrow.config import EngineConfig
    from sparrow.layers.linear import LinearBase
    from sparrow.layers.linear_weights import LinearWeights
    from sparrow.ops.base import OpImpl

__all__ = ["QuantizationMethod", "building_method", "get_quantization_method", "hf_quant_config", "linear_weights_for",
           "op_overrides_for", "quantization_method_class", "quantization_scope", "resolve_quantization"]

# The method the model being built is quantized with (see quantization_scope).
_BUILDING: contextvars.ContextVar[QuantizationMethod | None] = contextvars.ContextVar("sparrow_quantization",
                                                                                     default=None)


class QuantizationMethod:
    """One quantization method (vLLM's QuantizationConfig), built in every process that uses it
    as ``cls(hf_quant_config)``: the frontend (to check the configuration) and each worker."""

    name: ClassVar[str] = ""

    def __init__(self, hf_quant_config: dict[str, Any] | None) -> None:
        # The checkpoint's ``quantization_config`` from config.json (None for an unquantized one,
        # which a method that quantizes on load accepts).
        self.hf_quant_config = hf_quant_config
        # The model's transformers config, set by get_quantization_method (None when built bare).
        self.hf_config: Any = None

    def check_config(self, config: EngineConfig) -> None:
        """Refuse, before any engine process starts, what this method cannot serve: raise
        :class:`sparrow.config.ConfigError` naming the field (``dtype``, ``device``...).
        ``config.device.device`` names the resolved platform. The default accepts everything."""

    def op_overrides(self, platform: str) -> dict[str, type[OpImpl]]:
        """``{op name: OpImpl class}`` serving those ops on ``platform`` instead of the platform's
        own implementations (layers whose ``supports`` refuses keep the torch reference)."""
        return {}

    def linear_weights(self, layer: LinearBase) -> LinearWeights | None:
        """How ``layer`` (a linear layer being built under this method) holds its weight: a
        :class:`sparrow.layers.linear_weights.LinearWeights` creating the parameters the checkpoint
        stores, or None for the dense ``weight`` (a method that quantizes after loading)."""
        return None


@contextlib.contextmanager
def quantization_scope(method: QuantizationMethod | None) -> Iterator[None]:
    """Build a model's layers under ``method`` (None: unquantized): linear layers created inside
    take their parameters from ``method.linear_weights``."""
    token = _BUILDING.set(method)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def building_method() -> QuantizationMethod | None:
    """The method the model being built is quantized with (None: unquantized, or not building)."""
    return _BUILDING.get()


def linear_weights_for(layer: LinearBase) -> LinearWeights | None:
    """What a linear layer being built asks: the current method's weights for it, or None (dense)."""
    method = _BUILDING.get()
    return method.linear_weights(layer) if method is not None else None


def resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The method an engine runs: the ``quantization`` argument, or the checkpoint's own
    (``quantization_config.quant_method`` in config.json) when it is unset, as vLLM does. Raises
    ValueError naming 'quantization' when the two disagree."""
    quant = hf_quant_config(hf_config)
    stored = str(quant.get("quant_method", "")).lower() if quant else ""
    if not stored:
        return requested
    if requested is None:
        return stored
    if requested != stored:
        raise ValueError(f"invalid engine argument 'quantization': {requested!r}, but the checkpoint is already "
                         f"quantized with quant_method {stored!r} (its config.json quantization_config); leave "
                         f"quantization unset or pass {stored!r}")
    return requested


def hf_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a transformers config as a dict, or None."""
    value = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if value is None or isinstance(value, dict):
        return value
    to_dict = getattr(value, "to_dict", None)  # transformers may have parsed it into an object
    return to_dict() if callable(to_dict) else dict(vars(value))


def quantization_method_class(name: str, registry: Any = None) -> type[QuantizationMethod]:
    """The class registered as ``name``; ValueError listing the registered names otherwise."""
    from sparrow.plugins import get_registry, resolve_parser

    registry = registry or get_registry()
    return resolve_parser("quantization method", name, registry.quantization_methods)


def get_quantization_method(config: EngineConfig, hf_config: Any = None,
                            registry: Any = None) -> QuantizationMethod | None:
    """The method ``config.model.quantization`` names, built for the model (``hf_config``, read
    from the model directory when not given), or None when the engine runs unquantized."""
    name = config.model.quantization
    if name is None:
        return None
    cls = quantization_method_class(name, registry)
    if hf_config is None and config.model.model is not None:
        from sparrow.model_loader import model_hf_config

        hf_config = model_hf_config(config.model)
    method = cls(hf_quant_config(hf_config))
    method.hf_config = hf_config
    return method


def op_overrides_for(config: EngineConfig, platform: str, hf_config: Any = None,
                     registry: Any = None) -> dict[str, type[OpImpl]]:
    """What the worker passes to ``sparrow.ops.bind_ops(..., overrides=...)``: the configured
    quantization method's OpImpl classes for ``platform`` ({} without quantization). Raises
    ValueError naming the method if it returns anything but layer ops mapped to OpImpl classes."""
    method = get_quantization_method(config, hf_config, registry)
    if method is None:
        return {}
    overrides = method.op_overrides(platform)
    from sparrow.ops import KERNEL_OPS
    from sparrow.ops.base import OpImpl

    if not isinstance(overrides, dict):
        raise ValueError(f"quantization method {config.model.quantization!r}: op_overrides({platform!r}) must "
                         f"return a dict of op name -> OpImpl class, got {type(overrides).__name__}")
    for op, impl in overrides.items():
        spec = KERNEL_OPS.get(op)
        if spec is None or spec.kind != "layer":
            layer_ops = ", ".join(name for name, s in KERNEL_OPS.items() if s.kind == "layer")
            raise ValueError(f"quantization method {config.model.quantization!r} overrides {op!r}, which is not a "
                             f"layer op (layer ops: {layer_ops})")
        if not (isinstance(impl, type) and issubclass(impl, OpImpl)):
            raise ValueError(f"quantization method {config.model.quantization!r} serves op {op!r} with {impl!r}, "
                             "which is not a sparrow.ops.OpImpl subclass")
    return dict(overrides)
