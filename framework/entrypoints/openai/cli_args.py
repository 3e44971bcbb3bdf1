"""The ``sparrow serve`` flags, apart from the server itself.

Every ``sparrow`` command builds the whole parser, ``--version`` and ``--help`` included, so this
module imports nothing heavy (no fastapi, uvicorn, engine or torch): the server stack is imported
only when ``serve`` actually runs (``_run_server``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from sparrow.entrypoints.openai.server_flags import (  # noqa: F401 - re-exported
    add_process_flags,
    apply_log_config,
    check_serve_flags,
    load_log_config,
    positive_int,
    tls_options,
)

DEFAULT_MAX_REQUEST_BODY_BYTES = 10 * 1024 * 1024
ENV_API_KEY = "SPARROW_API_KEY"
# The same values as lifecycle.DEFAULT_SHUTDOWN_TIMEOUT_S, serving_models.ENV_RUNTIME_LORA and
# sparrow.worker.profiler.PROFILER_DIR_ENV, repeated here so that building the parser (and the
# server) does not import those modules (a test keeps them equal).
DEFAULT_SHUTDOWN_TIMEOUT_S = 0.0
ENV_RUNTIME_LORA = "SPARROW_ALLOW_RUNTIME_LORA_UPDATING"
ENV_PROFILER_DIR = "SPARROW_TORCH_PROFILER_DIR"


# vLLM serve flags (not engine arguments) that sparrow serve does not take, and why: the command
# line's "unrecognized arguments" error gives the reason (sparrow.entrypoints.cli).
_ONE_MACHINE_DP = ("data parallelism runs on one machine here: data_parallel_size engines behind one server "
                   "(docs/distributed.md); several machines serve one model through multi-node tensor parallelism "
                   "(`sparrow worker`)")
VLLM_SERVE_FLAGS_NOT_TAKEN = {
    "headless": _ONE_MACHINE_DP,
    "data_parallel_address": _ONE_MACHINE_DP,
    "data_parallel_rpc_port": _ONE_MACHINE_DP,
    "data_parallel_start_rank": _ONE_MACHINE_DP,
    "data_parallel_size_local": _ONE_MACHINE_DP,
    "data_parallel_hybrid_lb": _ONE_MACHINE_DP,
    "data_parallel_external_lb": _ONE_MACHINE_DP,
    "enable_ssl_refresh": "the TLS key and certificate are read once, at start-up; restart the server to load new "
                          "ones",
    "tool_server": "the Responses API has no built-in tools (MCP or demo tool servers); function tools work",
    "disable_frontend_multiprocessing": "the server runs the engine's frontend (AsyncLLM) in its own process and the "
                                        "engine core in another, always; SPARROW_ENABLE_MULTIPROCESSING=0 keeps the "
                                        "engine core in the server's process (for debugging)",
    "enable_offline_docs": "the /docs page loads Swagger UI from its CDN; --disable-fastapi-docs turns the docs off",
}


def _run_server(args: argparse.Namespace) -> int:
    # The flags checked here fail in a blink, before the server stack (and torch) is imported.
    check_serve_flags(args)
    from sparrow.entrypoints.openai.api_server import run_server

    return run_server(args)


def _port(value: str) -> int:
    # 0 asks the system for a free port (the start-up line "serving ... on http(s)://HOST:PORT" names
    # it); anything outside 0-65535 is not a TCP port, whatever the socket library makes of it.
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1-65535 (or 0 for any free port), got {value!r}")
    return port


def _positive_bytes(value: str) -> int:
    return positive_int(value, "a number of bytes")


def _shutdown_timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
    return seconds


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f'must be a JSON list of strings, e.g. \'["https://example.com"]\', '
                                         f'got {value!r}')
    return parsed


def _chat_template(value: str) -> str:
    """The template text of ``--chat-template``: the file the value names, else the value itself
    when it looks like a template (it has ``{{`` or ``{%``); compiled now, so that a syntax error
    is reported at start-up rather than on every request."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as file:
                template = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {value!r}: {exc}") from None
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise argparse.ArgumentTypeError(f"no such file: {value!r} (and not an inline template: no '{{{{' or "
                                         "'{%')")
    problem = chat_template_error(template)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"not a valid Jinja template: {problem}")
    return template


def chat_template_error(template: str) -> str | None:
    """Why ``template`` does not compile as transformers compiles chat templates; None when it does."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: the same environment, less its {% generation %} tag
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def _compile_jinja_template(text: str) -> Any:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                               extensions=["jinja2.ext.loopcontrols"])
            return env.from_string(text)
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        return f"line {exc.lineno}: {exc.message}"
    return None


def _max_log_len(value: str) -> int:
    try:
        length = int(value)
    except ValueError:
        length = -1
    if length < 0:
        raise argparse.ArgumentTypeError(f"must be a number of characters (and token ids) >= 0, got {value!r}")
    return length


def _middleware(value: str) -> Any:
    """``--middleware``'s import path (``package.module.Name`` or ``package.module:Name``): an
    ASGI middleware class, or an ``async def (request, call_next)`` function; imported now, so that
    a wrong path is reported at start-up."""
    import importlib
    import inspect

    module_name, _, name = value.rpartition(":") if ":" in value else value.rpartition(".")
    if not module_name or not name:
        raise argparse.ArgumentTypeError(f"expected an import path package.module.Name, got {value!r}")
    try:
        middleware = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot import {value!r}: {exc}") from None
    if not (inspect.isclass(middleware) or inspect.iscoroutinefunction(middleware)):
        raise argparse.ArgumentTypeError(f"{value!r} is neither a class (an ASGI middleware) nor an async function "
                                         f"(request, call_next); got {type(middleware).__name__}")
    return middleware


def _nonempty(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _root_path(value: str) -> str:
    if value and not value.startswith("/"):
        raise argparse.ArgumentTypeError(f"must start with '/' (or be empty), got {value!r}")
    return value


def _cert_reqs(value: str) -> int:
    # Python's ssl.CERT_NONE, CERT_OPTIONAL and CERT_REQUIRED (uvicorn's --ssl-cert-reqs).
    if value.strip() not in ("0", "1", "2"):
        raise argparse.ArgumentTypeError(f"must be 0 (ssl.CERT_NONE), 1 (ssl.CERT_OPTIONAL) or 2 (ssl.CERT_REQUIRED), "
                                         f"got {value!r}")
    return int(value)


def _template_kwargs(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f'must be a JSON object of template variables, e.g. \'{{"enable_thinking": '
                                         f'false}}\', got {value!r}')
    return parsed


def _lora_module(value: str) -> dict[str, Any]:
    # serving_models needs the server stack: imported only when --lora-modules is given.
    from sparrow.entrypoints.openai.serving_models import parse_lora_module

    return parse_lora_module(value)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sparrow serve [MODEL]`` with server flags and every engine argument."""
    from sparrow.entrypoints.cli import add_engine_args

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (see docs/serving.md). The process exits "
                    "with code 0 after SIGTERM or Ctrl+C, and with code 1 when the engine core dies.")
    parser.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                        help="local model directory (default: the built-in sparrow-tiny)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 for every IPv4 interface (default: 127.0.0.1)")
    server.add_argument("--port", type=_port, default=8000,
                        help="TCP port to listen on, 1-65535, or 0 for a free port the start-up line names; "
                             "checked before the model loads (default: 8000)")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${ENV_API_KEY} if set, "
                             "else no authentication)")
    server.add_argument("--max-request-body-bytes", type=_positive_bytes, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help=f"answer larger request bodies with 413 (default: {DEFAULT_MAX_REQUEST_BODY_BYTES}, "
                             "10 MiB)")
    server.add_argument("--shutdown-timeout", type=_shutdown_timeout, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        metavar="SECONDS",
                        help="on SIGTERM or Ctrl+C, refuse new requests and let those in flight run this long; "
                             "then end the rest with an error (streams: an error event and [DONE]). 0 ends "
                             f"them at once, as vLLM does (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    server.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                        help='CORS: origins a browser page may call the API from, a JSON list '
                             '(default: ["*"], any origin, as vLLM)')
    server.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                        help='CORS: HTTP methods allowed from those origins, a JSON list (default: ["*"])')
    server.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                        help='CORS: request headers allowed from those origins, a JSON list (default: ["*"])')
    server.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let those origins send cookies and HTTP auth (default: off)")
    server.add_argument("--uvicorn-log-level", default=None,
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the HTTP server's own messages (default: info; with --log-config-file, "
                             "the file's)")
    server.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action="store_true",
                        dest="disable_access_log",
                        help="do not log one line per HTTP request (default: off, every request is logged)")
    server.add_argument("--disable-fastapi-docs", action="store_true",
                        help="serve no /docs, /redoc or /openapi.json (default: off, they are served)")
    server.add_argument("--middleware", type=_middleware, action="append", default=None, metavar="PATH",
                        help="an ASGI middleware to add to the app, by import path (package.module.Name): a class "
                             "is added with app.add_middleware, an async function (request, call_next) as an "
                             "HTTP middleware; repeat the flag for more; vLLM's flag (default: none)")
    server.add_argument("--enable-server-load-tracking", action="store_true",
                        help="count the completion and chat requests in flight, reported by GET /load as "
                             "{\"server_load\": N}; vLLM's flag (default: off, and /load reads 0)")
    server.add_argument("--enable-request-id-headers", action="store_true",
                        help="add X-Request-Id to every response: the request's own X-Request-Id header, else "
                             "a random id; vLLM's flag (default: off)")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="vLLM's flag for GET /tokenizer_info, which this server always serves: "
                             "lm-evaluation-harness finds the server's tokenizer through it (default: always on)")
    server.add_argument("--root-path", type=_root_path, default="", metavar="PATH",
                        help="the path prefix a proxy serves the API under (uvicorn's --root-path): the "
                             "OpenAPI schema and /docs name it; requests still arrive without it (default: none)")
    server.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                        help="serve HTTPS: the server's private key, a PEM file (needs --ssl-certfile); vLLM's "
                             "flag (default: none, plain HTTP)")
    server.add_argument("--ssl-certfile", default=None, metavar="FILE",
                        help="serve HTTPS: the server's certificate (chain), a PEM file (needs --ssl-keyfile); "
                             "the pair is loaded before the model is (default: none, plain HTTP)")
    server.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                        help="with --ssl-keyfile and --ssl-certfile: the CA certificates (PEM) that client "
                             "certificates are verified against (default: none)")
    server.add_argument("--ssl-cert-reqs", type=_cert_reqs, default=None, metavar="{0,1,2}",
                        help="with --ssl-keyfile and --ssl-certfile: whether a client certificate is asked for, as "
                             "Python's ssl module numbers it: 0 CERT_NONE, 1 CERT_OPTIONAL, 2 CERT_REQUIRED (1 "
                             "and 2 need --ssl-ca-certs) (default: 0)")
    server.add_argument("--log-config-file", default=None, metavar="FILE",
                        help="a logging.config.dictConfig configuration, JSON (YAML for .yaml/.yml), applied to "
                             "this process's logging (the sparrow and uvicorn loggers) before the model loads, "
                             "instead of uvicorn's own; --uvicorn-log-level then applies only when given; vLLM's "
                             "flag (default: none)")
    add_api_flags(parser.add_argument_group("API", "templates, parsers, request logging (sparrow run-batch takes "
                                                   "these too)"))
    add_process_flags(server)
    add_engine_args(parser)
    parser.set_defaults(func=_run_server)
    return parser


def add_api_flags(group: Any) -> None:
    """The flags that shape the API's answers (templates, parsers, logging, usage): ``sparrow
    serve`` and ``sparrow run-batch`` both take them."""
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens, the prompt tokens the prefix "
                            "cache held, in every response (default: off, prompt_tokens_details is null)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="every request's logprob tokens as 'token_id:N', as if each asked for it with "
                            "return_tokens_as_token_ids (default: off)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="answer tool_choice \"auto\" (the default when a request has tools) by parsing the "
                            "model's tool calls with --tool-call-parser (default: off, such requests are a 400)")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json "
                            "(Llama 3.x), mistral, pythonic (Llama 3.2/4), qwen3_coder, deepseek_v3 (DeepSeek-V3, "
                            "R1), glm45 (GLM-4.5/4.6), kimi_k2, granite (Granite 3.x), phi4_mini_json, or a "
                            "plugin's (`sparrow plugins` lists them) (default: none)")
    group.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                       help="a Python file that registers tool parsers (a sparrow_register_tool_parsers hook "
                            "implementation), loaded before --tool-call-parser is looked up: a parser that is "
                            "not an installed plugin (default: none)")
    group.add_argument("--lora-modules", type=_lora_module, nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters to serve, each as name=path or JSON {\"name\": ..., \"path\": ..., "
                            "\"base_model_name\": ...}; a request selects one by its model name (needs "
                            f"--enable-lora; {ENV_RUNTIME_LORA}=true also enables /v1/load_lora_adapter and "
                            "/v1/unload_lora_adapter) (default: none)")
    group.add_argument("--chat-template", type=_chat_template, default=None, metavar="TEMPLATE",
                       help="the chat template for /v1/chat/completions and /tokenize with messages, instead of "
                            "the tokenizer's: a Jinja file, or the template itself; a request's chat_template "
                            "wins where --trust-request-chat-template allows it (default: the tokenizer's)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a request's own chat_template (vLLM's flag): it runs the client's Jinja "
                            "on the server, so by default such a request is refused with a 400 (default: off)")
    group.add_argument("--chat-template-content-format", choices=("auto", "string", "openai"), default="auto",
                       help="how a message's list of text parts reaches the chat template: joined into one "
                            "string, kept as OpenAI's parts, or auto: parts when the template loops over a "
                            "message's content (default: auto)")
    group.add_argument("--response-role", type=_nonempty, default="assistant", metavar="ROLE",
                       help="the role of the reply message when the request's add_generation_prompt is true "
                            "(default: assistant)")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's id, prompt, prompt token ids, sampling parameters and LoRA "
                            "adapter at INFO (default: off)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="end every streamed response with its usage chunk, as if the request's "
                            "stream_options.include_usage were true; vLLM's flag (default: off)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="vLLM's older flag: do not log requests, which is the default here too; refused "
                            "beside --enable-log-requests (default: off)")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="with --enable-log-requests, also log each finished request's output text, token "
                            "ids and finish reason at INFO (default: off)")
    group.add_argument("--max-log-len", type=_max_log_len, default=None, metavar="N",
                       help="with --enable-log-requests, log at most N characters of the prompt and N of its "
                            "token ids (default: unlimited)")
    group.add_argument("--default-chat-template-kwargs", type=_template_kwargs, default=None, metavar="JSON",
                       help="chat template variables for every chat request, e.g. '{\"enable_thinking\": false}'; "
                            "a request's own chat_template_kwargs win key by key; vLLM's flag (default: none)")
    group.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help="a chat request with tool_choice \"none\" is rendered without its tools (by default "
                            "the template still sees them); vLLM's flag (default: off)")
    group.add_argument("--log-error-stack", action="store_true",
                       help="log the stack trace behind every error response (a 4xx or 5xx, or an error event "
                            "in a stream) at ERROR; vLLM's flag (default: off)")
