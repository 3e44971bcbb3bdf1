"""msgpack encoding of the messages between the frontend and the engine core.

Every message to the engine core is two ZMQ frames, ``[request_type, payload]``:

    ADD      payload = EngineCoreRequest
    ABORT    payload = [request_id, ...]
    UTILITY  payload = [call_id, method_name, [arg, ...]]

The engine core checks every message it receives: a malformed one is answered with an error
output (ADD, when its request id can be read) or a failed utility result, or logged and dropped.

Every message from the engine core is one frame: the handshake (a ``HandshakeMessage``) first,
then ``EngineCoreOutputs`` for the rest of its life.

Utility results are ``Any`` on the wire, so a msgspec Struct (e.g. ``SchedulerStats``) would come
back as a bare list. ``encode_result`` tags a top-level Struct with its import path and
``decode_result`` rebuilds it; only types from sparrow's own packages are rebuilt, so a message
can never make the frontend import arbitrary code.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any

import msgspec

# The message types live in sparrow.wire; HandshakeMessage is re-exported for serial's callers.
from sparrow.wire import EngineCoreOutputs, EngineCoreRequest, HandshakeMessage

__all__ = [
    "HandshakeMessage", "decode_result", "describe_invalid_request", "encode_result", "generic_decoder",
    "handshake_decoder", "make_encoder", "outputs_decoder", "peek_request_id", "request_decoder",
]

_STRUCT_TAG = "__sparrow_struct__"
_TRUSTED_MODULE_PREFIXES = ("sparrow.", "sparrow_")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreRequest)


def outputs_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreOutputs)


def handshake_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(HandshakeMessage)


def generic_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder()


def peek_request_id(payload: Any) -> str | None:
    """The request id of an ADD payload that did not decode as an EngineCoreRequest, when it can
    still be read (the first element of the array), so that the engine core can fail that
    request instead of leaving its caller waiting; None when the payload holds none."""
    try:
        body = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(body, list) and body and isinstance(body[0], str) and body[0]:
        return body[0]
    return None


_PATH = re.compile(r"`\$((?:\[\d+\])+)`")


def describe_invalid_request(exc: Exception) -> str:
    """msgspec's error for an ADD payload, with its array path (``$[2][12]``: the wire is
    array-like) spelled as field names (``sampling_params.max_tokens``)."""
    message = str(exc)
    match = _PATH.search(message)
    if match is None:
        return message
    cls: Any = EngineCoreRequest
    names: list[str] = []
    for index in map(int, re.findall(r"\d+", match.group(1))):
        fields = msgspec.structs.fields(cls) if isinstance(cls, type) and issubclass(cls, msgspec.Struct) else None
        if fields is not None and index < len(fields):
            names.append(fields[index].name)
            cls = fields[index].type
        else:
            names.append(f"[{index}]")
            cls = None
    path = ".".join(names).replace(".[", "[")
    return f"{message[:match.start()]}`{path}`{message[match.end():]}"


def encode_result(value: Any) -> Any:
    """A utility result as builtins, with a top-level Struct or dataclass tagged by type."""
    if isinstance(value, msgspec.Struct) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        cls = type(value)
        return {_STRUCT_TAG: f"{cls.__module__}:{cls.__qualname__}", "data": msgspec.to_builtins(value)}
    return value


def decode_result(value: Any) -> Any:
    if not (isinstance(value, dict) and _STRUCT_TAG in value):
        return value
    path = value[_STRUCT_TAG]
    module_name, _, qualname = path.partition(":")
    if not module_name.startswith(_TRUSTED_MODULE_PREFIXES):
        raise ValueError(f"utility result type {path!r} is not a sparrow type")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return msgspec.convert(value["data"], obj)
