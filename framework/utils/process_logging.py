"""Logging in Sparrow's own processes (the engine core, tensor-parallel workers).

A process started by the engine configures its logging once, at start-up: from the logging
configuration file ``$SPARROW_LOGGING_CONFIG_PATH`` names (``logging.config.dictConfig``'s
dictionary, JSON or YAML, as ``sparrow serve --log-config-file`` reads it; the server sets the
variable to that file, so the engine's processes log where the server does), else with
``logging.basicConfig`` at ``$SPARROW_LOGGING_LEVEL`` and a format that names the process.
vLLM's ``VLLM_LOGGING_CONFIG_PATH`` does the same.
"""

from __future__ import annotations

import logging
import os

ENV_LOGGING_CONFIG_PATH = "SPARROW_LOGGING_CONFIG_PATH"


def setup_process_logging(process_tag: str) -> None:
    """Configure this process's logging (see the module docstring); ``process_tag`` goes into
    the default format, e.g. ``EngineCore pid=123``. A configuration file that cannot be applied
    falls back to the default, with a warning naming the variable."""
    path = os.environ.get(ENV_LOGGING_CONFIG_PATH)
    problem = None
    if path:
        from sparrow.entrypoints.openai.server_flags import apply_log_config, load_log_config

        try:
            apply_log_config(load_log_config(path), path)
            return
        except ValueError as exc:
            problem = str(exc).replace("--log-config-file", f"${ENV_LOGGING_CONFIG_PATH}", 1)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=os.environ.get("SPARROW_LOGGING_LEVEL", "INFO").upper(),
            format=f"%(levelname)s %(asctime)s [{process_tag}] %(name)s: %(message)s",
        )
    if problem is not None:
        logging.getLogger(__name__).warning("logging configuration not applied: %s", problem)
