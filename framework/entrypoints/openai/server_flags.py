"""The ``sparrow serve`` flags that configure the server process rather than a request: TLS
(``--ssl-*``, checked and turned into uvicorn's keywords), ``--log-config-file`` (applied to
this process's logging once, and by the engine's processes through
``$SPARROW_LOGGING_CONFIG_PATH``, sparrow.utils.process_logging), the HTTP parser's limits
(``--h11-*``) and vLLM's ``--api-server-count``. Checked before the model loads; every error is a
ValueError naming the flag. Imports nothing heavy (``sparrow`` builds every command's parser from
cli_args).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

# vLLM's default for --h11-max-header-count: a request with more header fields is a 431.
DEFAULT_MAX_HEADER_COUNT = 256


def positive_int(value: str, what: str = "a whole number") -> int:
    """An argparse type: ``value`` as an int >= 1, else an error saying it must be ``what`` >= 1."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be {what} >= 1, got {value!r}")
    return number


def _api_server_count(value: str) -> int:
    count = positive_int(value)
    if count != 1:
        raise argparse.ArgumentTypeError(
            f"only 1 is taken, got {value!r}: sparrow serve runs one API server process, which streams every "
            "engine's outputs (data_parallel_size engines included); run several servers behind a load balancer "
            "for more")
    return count


def add_process_flags(server: Any) -> None:
    """The flags of the server process (TLS ciphers, the HTTP parser's limits, the number of API
    server processes) in the ``server`` argument group; vLLM's names and meanings."""
    server.add_argument("--ssl-ciphers", default=None, metavar="CIPHERS",
                        help="with --ssl-keyfile and --ssl-certfile: the ciphers TLS offers, in OpenSSL's cipher "
                             "list format (uvicorn's --ssl-ciphers); vLLM's flag (default: uvicorn's, TLSv1)")
    server.add_argument("--h11-max-incomplete-event-size", type=positive_int, default=None, metavar="BYTES",
                        help="the most bytes of a request's line and headers the HTTP/1.1 parser buffers; a "
                             "longer head is answered with an error and the connection closed (uvicorn's "
                             "h11_max_incomplete_event_size); vLLM's flag (default: h11's, 16384)")
    server.add_argument("--h11-max-header-count", type=positive_int, default=DEFAULT_MAX_HEADER_COUNT,
                        metavar="N", help="a request with more header fields than this is answered 431 (Request "
                                          "Header Fields Too Large); vLLM's flag "
                                          f"(default: {DEFAULT_MAX_HEADER_COUNT})")
    server.add_argument("--api-server-count", type=_api_server_count, default=1, metavar="N",
                        help="vLLM's number of API server processes: 1, the one process that serves every engine "
                             "(default: 1)")


def _readable_file(flag: str, path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no such file: {path!r}")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {exc.strerror or exc}") from None


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> str:
    raise _EncryptedKey


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's ``ssl_*`` keywords from the --ssl-* flags ({} without TLS), checked before the
    model loads: every file readable, the key and certificate given together and loading as a
    pair, the CA file loading, and the client-certificate flags given only with them. ValueError
    naming the flag otherwise."""
    import ssl

    keyfile, certfile = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    ca_certs, cert_reqs = getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", None)
    if keyfile is None and certfile is None:
        for flag, value in (("--ssl-ca-certs", ca_certs), ("--ssl-cert-reqs", cert_reqs),
                            ("--ssl-ciphers", getattr(args, "ssl_ciphers", None))):
            if value is not None:
                raise ValueError(f"{flag} needs --ssl-keyfile and --ssl-certfile (the server's key and certificate)")
        return {}
    if keyfile is None or certfile is None:
        given, missing = ("--ssl-keyfile", "--ssl-certfile") if certfile is None else ("--ssl-certfile",
                                                                                      "--ssl-keyfile")
        raise ValueError(f"{given} needs {missing} too: TLS takes the server's key and its certificate")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs)):
        if path is not None:
            _readable_file(flag, path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except _EncryptedKey:
        # OpenSSL would ask for the passphrase on the terminal (here, and again in uvicorn).
        raise ValueError(f"--ssl-keyfile: {keyfile!r} is encrypted, and sparrow serve takes no passphrase (nor does "
                         "vLLM's): give the key unencrypted (openssl pkey -in KEY -out PLAIN_KEY)") from None
    except ssl.SSLError as exc:
        raise ValueError(f"--ssl-keyfile / --ssl-certfile: {keyfile!r} and {certfile!r} do not load as a PEM private "
                         f"key and its certificate: {exc.reason or exc}") from None
    ciphers = getattr(args, "ssl_ciphers", None)
    if ciphers is not None:
        try:
            context.set_ciphers(ciphers)
        except ssl.SSLError:
            raise ValueError(f"--ssl-ciphers: {ciphers!r} selects no cipher OpenSSL knows (an OpenSSL cipher list, "
                             "e.g. 'ECDHE+AESGCM')") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(cafile=ca_certs)
        except ssl.SSLError as exc:
            raise ValueError(f"--ssl-ca-certs: {ca_certs!r} holds no PEM CA certificate: {exc.reason or exc}") from None
    if cert_reqs not in (None, ssl.CERT_NONE) and ca_certs is None:
        raise ValueError(f"--ssl-cert-reqs {cert_reqs} asks clients for a certificate, which the server can verify "
                         "only against --ssl-ca-certs: give it")
    options = {"ssl_keyfile": keyfile, "ssl_certfile": certfile, "ssl_ca_certs": ca_certs,
               "ssl_cert_reqs": ssl.CERT_NONE if cert_reqs is None else cert_reqs}
    if ciphers is not None:
        options["ssl_ciphers"] = ciphers
    return options


def load_log_config(path: str) -> dict[str, Any]:
    """--log-config-file's logging configuration (``logging.config.dictConfig``'s dictionary):
    JSON, or YAML for a .yaml/.yml file. ValueError naming the flag when the file is missing,
    does not parse or is not a mapping (``apply_log_config`` finds the rest)."""
    _readable_file("--log-config-file", path)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"--log-config-file: {path!r} is not UTF-8 text: {exc}") from None
    if path.lower().endswith((".yaml", ".yml")):
        import yaml

        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"--log-config-file: {path!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    else:
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--log-config-file: {path!r} is not valid JSON ({exc}); a .yaml or .yml file is "
                             "read as YAML") from None
    if not isinstance(config, dict):
        raise ValueError(f"--log-config-file: {path!r} must hold a mapping (a logging.config.dictConfig "
                         f"configuration, with \"version\": 1), got {type(config).__name__}")
    return config


def apply_log_config(config: dict[str, Any], path: str) -> None:
    """Configure this process's logging with ``config`` (``logging.config.dictConfig``); ValueError
    naming --log-config-file when it is not a valid configuration."""
    import logging.config

    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        message = f"{exc}" + (f": {exc.__cause__}" if exc.__cause__ is not None else "")
        raise ValueError(f"--log-config-file: {path!r} is not a valid logging configuration: {message}") from None


# The --log-config-file this process applied (check_serve_flags applies it once).
_applied_log_config: list[str] = []


def check_serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Check the flags that need no server stack, and apply them: the --ssl-* files
    (``tls_options``) and --log-config-file (applied to this process's logging, once). Returns
    ``uvicorn.Config``'s keywords for TLS and logging. ValueError naming the flag; safe to call
    again."""
    kwargs = tls_options(args)
    event_size = getattr(args, "h11_max_incomplete_event_size", None)
    if event_size is not None:
        kwargs["h11_max_incomplete_event_size"] = event_size
    log_config_file = getattr(args, "log_config_file", None)
    if log_config_file is not None:
        if log_config_file not in _applied_log_config:
            apply_log_config(load_log_config(log_config_file), log_config_file)
            _applied_log_config.append(log_config_file)
        # The engine's processes (engine core, workers) apply the same file when they start.
        from sparrow.utils.process_logging import ENV_LOGGING_CONFIG_PATH

        os.environ[ENV_LOGGING_CONFIG_PATH] = os.path.abspath(log_config_file)
        # Already applied (before the engine starts, so that its loggers follow it): uvicorn must
        # not configure logging again, which would reopen the file's handlers.
        kwargs["log_config"] = None
    # uvicorn's own loggers: at --uvicorn-log-level, else info, else (with a file) the file's levels.
    kwargs["log_level"] = getattr(args, "uvicorn_log_level", None) or (None if log_config_file else "info")
    return kwargs
