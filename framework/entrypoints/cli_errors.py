"""How the `sparrow` command ends on an error: one line the user can act on and an exit status.

A mistake by the user (a bad flag value, a missing model or weight file, an unknown scheduler or
device, a busy port) is ``sparrow: error: <message>`` and status 2, argparse's status for a usage
error, so every user mistake exits alike; a failure at run time is status 1; anything else is a
bug, re-raised with its traceback.
"""

from __future__ import annotations

import re

EXIT_RUNTIME_FAILURE = 1
EXIT_USER_ERROR = 2  # argparse's status for a usage error, so every user mistake exits alike
EXIT_INTERRUPTED = 130  # the shell's status for a command stopped by SIGINT
# Exceptions raised inside the engine process reach the frontend as traceback text: these names
# there are the user's mistake (a model directory, a flag), anything else is a failure.
USER_ERROR_NAMES = ("ConfigError", "ValueError", "FileNotFoundError", "WeightFileError", "MissingWeightsError",
                    "UnsupportedArchitectureError", "PluginError")


class CommandFailed(Exception):
    """A command that ran but did not do all it was asked (some grid points of an ablation failed,
    say): its message is the one line printed, with status 1."""


def describe_error(exc: BaseException) -> tuple[str, int] | None:
    """(one-line message, exit status) for an error the user can act on; None for a bug."""
    from sparrow.config import ConfigError
    from sparrow.engine.exceptions import EngineDeadError, EngineStartupError
    from sparrow.plugins import PluginError

    if isinstance(exc, EngineStartupError):
        name, message = _root_cause(str(exc))
        status = EXIT_USER_ERROR if name.rsplit(".", 1)[-1] in USER_ERROR_NAMES else EXIT_RUNTIME_FAILURE
        return f"the engine failed to start: {message}", status
    if isinstance(exc, (ConfigError, ValueError, FileNotFoundError, PluginError)):
        return _one_line(str(exc)), EXIT_USER_ERROR
    if isinstance(exc, (EngineDeadError, OSError, CommandFailed)):
        return _one_line(str(exc)), EXIT_RUNTIME_FAILURE
    return None


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.+)$")


def _root_cause(text: str) -> tuple[str, str]:
    """(exception name, message) of the innermost exception in a traceback's text: the last line
    that reads ``SomeError: message``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line)
        if match:
            return match.group(1), match.group(2)
    return "", lines[-1] if lines else text


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip()) or "(no message)"


def explain_vllm_flags(message: str) -> str:
    """argparse's "unrecognized arguments: ..." with the reason for each vLLM flag Sparrow does
    not take (``--swap-space (vLLM's) is not taken: ...``); any other message as it is."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return message
    from sparrow.config import VLLM_ARGUMENTS_NOT_TAKEN
    from sparrow.entrypoints.openai.cli_args import VLLM_SERVE_FLAGS_NOT_TAKEN

    reasons = {**VLLM_ARGUMENTS_NOT_TAKEN, **VLLM_SERVE_FLAGS_NOT_TAKEN}
    explained, others = [], []
    for arg in message[len(prefix):].split():
        name = arg.partition("=")[0].lstrip("-").replace("-", "_")
        if re.fullmatch(r"-O[0-3]?|--optimization-level(=.*)?", arg):  # vLLM's compilation level
            explained.append(f"{arg} (vLLM's) is not taken: {reasons['compilation_config']}")
        elif arg.startswith("--") and name in reasons:
            explained.append(f"--{name.replace('_', '-')} (vLLM's) is not taken: {reasons[name]}")
        elif arg.startswith("-") or not explained:
            others.append(arg)  # a value after an explained flag is that flag's
    if not explained:
        return message
    return "; ".join(explained + ([prefix + " ".join(others)] if others else []))

