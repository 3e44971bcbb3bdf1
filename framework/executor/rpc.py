"""What ``collective_rpc`` may call on every worker: a method name, or a function of the worker.

vLLM's ``collective_rpc(method, timeout, args, kwargs)`` takes either the name of a worker method
or a callable ``func(worker, *args, **kwargs)``; ``apply_model(func)`` is the callable
``func(worker's model)``. Messages between Sparrow's processes are msgpack, which carries no
functions, so a callable travels as cloudpickle bytes (lambdas and closures included), made in the
caller and loaded by each worker, and its result comes back pickled (any Python value, tensors
included); a name travels as it is, and its result as msgpack.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

from sparrow.errors import InvalidArgumentError


def encode_method(method: Any) -> str | bytes:
    """``method`` as it crosses processes: a name as is, a callable as cloudpickle bytes."""
    if isinstance(method, str):
        if not method or method.startswith("_"):
            raise InvalidArgumentError(f"collective_rpc: method must name a public worker method, got {method!r}",
                                       "method")
        return method
    if callable(method):
        import cloudpickle

        try:
            return cloudpickle.dumps(method)
        except Exception as exc:  # noqa: BLE001 - whatever cannot be pickled is the caller's to fix
            raise InvalidArgumentError(f"collective_rpc: the function cannot be sent to the workers "
                                       f"(cloudpickle: {exc!r})", "method") from None
    raise InvalidArgumentError(f"collective_rpc: method must be a worker method's name or a function of the "
                               f"worker, got {type(method).__name__}", "method")


def check_rpc_call(timeout: Any, args: Any, kwargs: Any) -> None:
    """``collective_rpc``'s other arguments, checked in the caller (ValueError naming each)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise InvalidArgumentError(f"collective_rpc: timeout must be a positive number of seconds or None, "
                                   f"got {timeout!r}", "timeout")
    if not isinstance(args, (tuple, list)):
        raise InvalidArgumentError(f"collective_rpc: args must be a tuple, got {type(args).__name__}", "args")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(key, str) for key in kwargs)):
        raise InvalidArgumentError("collective_rpc: kwargs must be a dict with string keys", "kwargs")


def utility_args(method: Any, timeout: Any, args: Any, kwargs: Any) -> tuple[Any, ...]:
    """The engine core's ``collective_rpc`` utility arguments for a caller's call, checked."""
    check_rpc_call(timeout, args, kwargs)
    return encode_method(method), list(args), dict(kwargs or {}), timeout


def resolve(worker: Any, method: str) -> Any:
    """``worker``'s attribute ``method`` (a method to call, or a value, which is returned as is)."""
    if method.startswith("_"):
        raise AttributeError(f"collective_rpc cannot call the private attribute {method!r}")
    if not hasattr(worker, method):
        raise AttributeError(f"the worker ({type(worker).__name__}) has no method {method!r}")
    return getattr(worker, method)


def run_function(worker: Any, method: bytes, args: Any, kwargs: dict[str, Any] | None) -> bytes:
    """Run a pickled ``func(worker, *args, **kwargs)``; its result pickled, for any Python value
    (a tensor too) to travel back as bytes (``load_results`` opens them in the caller)."""
    return pickle.dumps(pickle.loads(method)(worker, *args, **(kwargs or {})))


def load_results(method: Any, results: list[Any]) -> list[Any]:
    """The callers' view of every rank's result: unpickled when ``method`` was a function."""
    return [pickle.loads(result) for result in results] if callable(method) else results


def call_on_model(func: Callable[[Any], Any], worker: Any) -> Any:
    """``apply_model``'s function, run on a worker: ``func`` of the worker's model (its
    ``torch.nn.Module``)."""
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None:
        raise AttributeError(f"apply_model: the worker ({type(worker).__name__}) holds no model")
    return func(model)


def describe(method: str | bytes) -> str:
    """The method's name for messages (a function's is not known after pickling)."""
    return method if isinstance(method, str) else "a function"
