"""Registered ops: a layer with a torch reference and one implementation chosen per platform.

A :class:`CustomOp` is an ``nn.Module`` whose ``forward`` calls the implementation the kernel
bound to it when the model was built (:func:`sparrow.ops.bind_ops`), or ``forward_native`` (the
torch reference) when no platform implementation serves it. An :class:`OpImpl` is one platform's
implementation of one op for one layer instance: built once, after the weights load, where it may
post-process (pack) the layer's weights; then called on every forward.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn


class OpImpl:
    """One platform's implementation of a registered op, bound to one layer.

    Subclass it, implement ``__call__`` with the same arguments and semantics as the op's
    ``forward_native`` (it may work in place on its inputs, never on the layer's weights), and
    register the class with ``sparrow_register_ops``. ``name`` is what ``sparrow plugins`` shows.
    """

    name: ClassVar[str] = ""

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    @classmethod
    def supports(cls, layer: Any) -> bool:
        """Whether this implementation can serve ``layer`` (its dtype, device, shapes); when False
        the layer keeps the torch reference. Called once per layer at bind time."""
        return True

    def process_weights(self) -> None:
        """Called once per layer after its weights loaded, before the first forward. May repack a
        weight into the implementation's own layout with ``self.layer.replace_parameter``; it runs
        again after each later load into a repacked weight (see :meth:`unpack_weights`)."""

    def unpack_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights :meth:`process_weights` repacked, back in their loaded layout (name ->
        tensor of the original shape and dtype), or None when this implementation cannot give them
        back (the default). When it can, the layer takes new weights after binding (RLHF weight
        updates through ``model.load_weights``, ``collective_rpc("reload_weights")``): each load
        into a repacked weight unpacks, loads into the dense weights, and repacks."""
        return None

    def release_weights(self) -> int:
        """Sleep level 2 (``LLM.sleep(level=2)``): drop the weights this implementation holds in a
        layout of its own (an opaque packed tensor, which the worker cannot shrink in place);
        returns the bytes released. The default releases nothing (such weights stay in memory)."""
        return 0

    def restore_weights(self) -> None:
        """Waking after :meth:`release_weights`: hold zeros of the same shapes again (the dense
        weights they came from are zeros too), ready for new weights to load."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name or type(self).__name__})"


class CustomOp(nn.Module):
    """A layer that is a registered op. Subclasses set ``op_name`` and define ``forward_native``."""

    op_name: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        self._op_impl: OpImpl | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        impl = self._op_impl
        if impl is not None:
            return impl(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    # -- the kernel's side: only sparrow.ops.bind_ops calls these ------------------------------
    def bind_impl(self, impl: OpImpl | None) -> None:
        self._op_impl = impl

    @property
    def op_impl(self) -> OpImpl | None:
        """The bound platform implementation, or None (the torch reference runs)."""
        return self._op_impl

    def replace_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Swap parameter ``name`` for ``tensor`` (a packed layout). The old one is released unless
        another module shares it. Loading weights into the replaced parameter later goes through
        the implementation's ``unpack_weights`` (refused where it has none)."""
        old = getattr(self, name, None)
        if isinstance(old, nn.Parameter) and not getattr(old, "repacked", False):
            # What the loaded parameter carried (its weight_loader, layout): restored on unpacking.
            self.__dict__.setdefault("_loaded_param_attrs", {})[name] = dict(vars(old))
        param = nn.Parameter(tensor, requires_grad=False)
        param.repacked = True  # type: ignore[attr-defined]
        param.weight_loader = functools.partial(_load_into_repacked, self, name)  # type: ignore[attr-defined]
        setattr(self, name, param)

    def layer_repr(self) -> str:
        """The layer's settings in its repr (what ``extra_repr`` is to a plain module)."""
        return ""

    def extra_repr(self) -> str:
        base = self.layer_repr()
        impl = self._op_impl
        if impl is None:
            return base
        label = f"impl={impl.name or type(impl).__name__}"
        return f"{base}, {label}" if base else label


def _load_into_repacked(layer: CustomOp, name: str, _param: nn.Parameter, loaded: Any, *args: Any,
                        **kwargs: Any) -> None:
    """The weight loader of a repacked parameter: unpack the layer's repacked weights, load
    ``loaded`` into the dense one as the original loader does (a fused shard keeps the others),
    and let the implementation repack them."""
    impl = layer.op_impl
    dense = impl.unpack_weights() if impl is not None else None
    if impl is None or dense is None:
        owner = f"the {impl.name or type(impl).__name__} implementation" if impl is not None else "a platform op"
        raise RuntimeError(f"{type(layer).__name__}.{name} was repacked by {owner} after loading, which cannot "
                           "unpack it; build a new model to load new weights")
    attrs = layer.__dict__.get("_loaded_param_attrs", {})
    for dense_name, tensor in dense.items():
        param = nn.Parameter(tensor, requires_grad=False)
        for key, value in attrs.get(dense_name, {}).items():
            setattr(param, key, value)
        setattr(layer, dense_name, param)
    target = getattr(layer, name)
    with torch.no_grad():
        target.weight_loader(target, loaded, *args, **kwargs)
        impl.process_weights()
