"""vLLM's ``EngineArgs`` and ``AsyncEngineArgs`` (``vllm.engine.arg_utils``): the engine arguments
as one object, for code written against vLLM's engine classes::

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)             # every engine argument as --kebab-case
    args = parser.parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    llm = LLM(**vars(args))                     # or straight into LLM: unset flags are None

The arguments are ``LLM``'s keywords, checked by name at once (``ConfigError``) and by value when
the engine is built (``create_engine_config``). Arguments that were set are the object's
attributes (``vars(engine_args)`` is them, ready for ``LLM(**vars(engine_args))``); an unset one
reads as its default.
"""

from __future__ import annotations

import argparse
from typing import Any

from sparrow.config import NONE_IS_A_VALUE, EngineConfig, check_engine_argument_name

__all__ = ["AsyncEngineArgs", "EngineArgs"]


class EngineArgs:
    """The engine arguments ``LLM``, ``LLMEngine.from_engine_args`` and ``AsyncLLM.from_engine_args``
    take, as one object; each may be reassigned before the engine is built."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.model = model
        for name, value in engine_args.items():
            setattr(self, name, value)

    @staticmethod
    def _check_name(name: str) -> None:
        check_engine_argument_name(name, EngineConfig.field_names())

    def __setattr__(self, name: str, value: Any) -> None:
        self._check_name(name)
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only for arguments that were not set
        if name.startswith("_"):
            raise AttributeError(name)
        self._check_name(name)
        return EngineConfig().flat()[name]

    def create_engine_config(self, usage_context: Any = None) -> EngineConfig:
        """The validated configuration (``usage_context`` is vLLM's telemetry tag; unused)."""
        return EngineConfig.from_kwargs(**vars(self))

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """Add every engine argument to ``parser`` as ``--kebab-case`` (the flags of ``sparrow
        serve``). An unset flag is None, the argument's default, except where None is a value of
        its own (``seed``: a random one), which defaults to the default. Returns the parser, as
        vLLM's does."""
        from sparrow.entrypoints.cli import add_engine_args

        add_engine_args(parser)
        defaults = EngineConfig().flat()
        parser.set_defaults(**{name: defaults[name] for name in NONE_IS_A_VALUE})
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine arguments set in ``args`` (parsed with ``add_cli_args``' flags)."""
        from sparrow.entrypoints.cli import engine_kwargs

        return cls(**engine_kwargs(args))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class AsyncEngineArgs(EngineArgs):
    """``EngineArgs`` for ``AsyncLLM.from_engine_args`` (vLLM's name; the same arguments)."""
