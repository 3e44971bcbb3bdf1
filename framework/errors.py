"""Errors Sparrow raises to its callers. A leaf module: it imports nothing from sparrow."""

from __future__ import annotations

from typing import Any


class InvalidArgumentError(ValueError):
    """A value the caller gave that Sparrow refuses, naming the field it came from.

    ``field`` is the request or argument field as the caller wrote it: ``"max_tokens"``,
    ``"stop[1]"``, ``"messages[2].content"``. ``code`` is an optional machine-readable reason
    (the OpenAI server's ``error.code``; ``"invalid_value"`` when None). It is a ValueError, so
    callers that catch ValueError keep working; the server turns it into a 400 whose ``param`` is
    the field, without reading the message.
    """

    def __init__(self, message: str, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # The default rebuilds with cls(*args), and args holds only the message: the field
        # would be lost (or the constructor fail) when the error is pickled across processes.
        return (_rebuild, (type(self), self.args, self.__dict__.copy()))


def _rebuild(cls: type[InvalidArgumentError], args: tuple[Any, ...],
             state: dict[str, Any]) -> InvalidArgumentError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


def error_from_engine(message: str, field: str | None) -> ValueError:
    """The exception a frontend raises for a request the engine core refused (the error finish
    of an ``EngineCoreOutput``): typed when the engine core named the field."""
    if field is None:
        return ValueError(message)
    return InvalidArgumentError(message, field)
