"""``sparrow chat``, ``sparrow complete`` and ``sparrow collect-env`` (vLLM's ``vllm chat``,
``vllm complete`` and ``vllm collect-env``; the environment report is ``sparrow.entrypoints.collect_env``).

``chat`` and ``complete`` are clients of a running OpenAI-compatible server (``sparrow serve``,
``vllm serve``, anything that speaks ``/v1/chat/completions`` and ``/v1/completions``). They use
the standard library only (``urllib`` and ``json``; the ``openai`` package is not needed) and read
the server-sent events of a streamed answer themselves.

Standard output carries only the model's text: each reply (``chat``) or continuation
(``complete``), followed by a newline. Everything else goes to standard error: the "Using model"
line of an interactive session, a reasoning model's ``reasoning_content`` (dimmed on a terminal;
it is not kept in the conversation) and ``--stats``. The ``> `` prompt is shown when standard
input is a terminal (on standard output when that is the terminal too). So ``sparrow chat <
questions.txt > answers.txt`` leaves only the answers in the file. Blank lines are skipped.

A server that cannot be reached or that refuses a request ends the command with one line,
``sparrow: error: <message>`` (the server's own ``error.message`` where it sends one), and exit
status 1. Ctrl-C ends an interactive session with status 0 (a ``-q`` command with 130, as any
interrupted ``sparrow`` command).

Only the parsers are built when this module is imported (every ``sparrow`` command builds every
parser, ``--version`` included): the HTTP client, torch and the rest are imported by the commands.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Iterator

from sparrow.entrypoints.cli_http import DEFAULT_URL, Client
from sparrow.entrypoints.openai.server_flags import positive_int

ENV_API_KEY = "OPENAI_API_KEY"
DIM, RESET = "\033[2m", "\033[0m"


# -- the parsers ----------------------------------------------------------------------------------
def _url(value: str) -> str:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number in 0-65535
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http:// or https:// URL with a host (e.g. "
                                         f"{DEFAULT_URL})")
    return value.rstrip("/")


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--url", type=_url, default=DEFAULT_URL,
                       help="the API base URL of the running OpenAI-compatible server, /v1 included "
                            f"(default: {DEFAULT_URL})")
    group.add_argument("--model-name", default=None, metavar="NAME",
                       help="the model to ask (default: the first model GET URL/models lists)")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else no key)")


def _add_stats_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stats", action="store_true",
                        help="after each answer, print its time to first token (TTFT) and tokens per second "
                             "(TPS) to standard error (default: off)")


def add_client_parsers(subparsers: Any) -> None:
    """The parsers of ``chat``, ``complete`` and ``collect-env``."""
    chat = subparsers.add_parser(
        "chat", help="chat with a model of a running OpenAI-compatible server (vLLM's `vllm chat`)",
        description="Chat with a model of a running OpenAI-compatible server: each line read from standard "
                    "input is a message, sent with the conversation so far to URL/chat/completions; the reply is "
                    "printed as it streams. Ends at the end of input (Ctrl-D) or Ctrl-C. Standard output carries "
                    "only the replies; prompts, reasoning and --stats go to standard error.")
    _add_connection_flags(chat)
    chat.add_argument("--system-prompt", default=None, metavar="TEXT",
                      help="a system message that opens the conversation (default: none)")
    chat.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                      help="send this one message, print the reply and exit (default: an interactive session "
                           "on standard input)")
    _add_stats_flag(chat)
    chat.set_defaults(func=cmd_chat)

    complete = subparsers.add_parser(
        "complete", help="complete prompts with a model of a running OpenAI-compatible server (vLLM's "
                         "`vllm complete`)",
        description="Complete prompts with a model of a running OpenAI-compatible server: each line read from "
                    "standard input is a prompt, sent alone to URL/completions; the continuation is printed as "
                    "it streams. Ends at the end of input (Ctrl-D) or Ctrl-C.")
    _add_connection_flags(complete)
    complete.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                          help="most tokens to generate per prompt (default: the server's)")
    complete.add_argument("-q", "--quick", default=None, metavar="PROMPT",
                          help="complete this one prompt, print the continuation and exit (default: an "
                               "interactive session on standard input)")
    _add_stats_flag(complete)
    complete.set_defaults(func=cmd_complete)

    collect = subparsers.add_parser(
        "collect-env", help="print the environment for a bug report (vLLM's `vllm collect-env`)",
        description="Print what a bug report needs: the Sparrow, Python and OS versions, the CPU and the "
                    "instruction sets Sparrow's CPU kernels use, torch and its CUDA build and GPUs, the "
                    "versions of the packages Sparrow relies on, the installed Sparrow plugins and the SPARROW_* "
                    "environment variables (values of names with KEY, TOKEN, SECRET or PASSWORD hidden).")
    # The SPARROW_* variables as the user set them: `sparrow` sets SPARROW_LOGGING_LEVEL for the
    # processes it starts before any command runs, after the parser is built.
    collect.set_defaults(func=cmd_collect_env, environ_at_start={
        name: value for name, value in os.environ.items() if name.startswith("SPARROW_")})


# -- chat and complete ----------------------------------------------------------------------------
class Answer:
    """Prints one streamed answer: its text to standard output as it arrives, the reasoning a
    server sends in ``reasoning_content`` (vLLM's newer ``reasoning`` too) to standard error."""

    def __init__(self, stats: bool) -> None:
        import time

        self.stats = stats
        self.start = time.perf_counter()
        self.first_token_s: float | None = None
        self.completion_tokens: int | None = None
        self.text: list[str] = []
        self.reasoning_open = False
        self.dim = sys.stderr.isatty()

    def show(self, chunks: Iterator[dict[str, Any]], field: str) -> str:
        """Print the answer's ``field`` ("delta" for chat, "text" for completions) as it streams
        and return its whole text."""
        try:
            for chunk in chunks:
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    self.completion_tokens = usage["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    if field == "text":
                        self._content(choice.get("text"))
                    else:
                        delta = choice.get("delta") or {}
                        self._reasoning(delta.get("reasoning_content") or delta.get("reasoning"))
                        self._content(delta.get("content"))
        except BaseException:
            self._end(partial=True)
            raise
        self._end(partial=False)
        if self.stats:
            self._print_stats()
        return "".join(self.text)

    def _end(self, partial: bool) -> None:
        """End the answer's line; a failed answer that printed nothing prints no empty line."""
        self._close_reasoning()
        if self.text or not partial:
            sys.stdout.write("\n")
        sys.stdout.flush()

    def _mark_first(self) -> None:
        import time

        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.start

    def _reasoning(self, text: Any) -> None:
        if not isinstance(text, str) or not text:
            return
        self._mark_first()
        if not self.reasoning_open:
            self.reasoning_open = True
            if self.dim:
                sys.stderr.write(DIM)
        sys.stderr.write(text)
        sys.stderr.flush()

    def _close_reasoning(self) -> None:
        if self.reasoning_open:
            self.reasoning_open = False
            sys.stderr.write((RESET if self.dim else "") + "\n")
            sys.stderr.flush()

    def _content(self, text: Any) -> None:
        if not isinstance(text, str) or not text:
            return
        self._mark_first()
        self._close_reasoning()
        self.text.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()

    def _print_stats(self) -> None:
        import time

        total = time.perf_counter() - self.start
        if self.first_token_s is None or total <= 0:
            return
        print(f"TTFT: {self.first_token_s * 1000:.2f} ms", file=sys.stderr)
        if self.completion_tokens is not None:
            print(f"TPS:  {self.completion_tokens / total:.2f} tokens/s ({self.completion_tokens} tokens in "
                  f"{total:.2f} s)", file=sys.stderr)


def _connect(args: argparse.Namespace) -> tuple[Client, str]:
    client = Client(args.url, args.api_key or os.environ.get(ENV_API_KEY) or None)
    return client, args.model_name or client.first_model()


def _read_line(prompt: str) -> str | None:
    """One line of standard input, None at its end. The prompt is shown only to someone typing
    (standard input a terminal): through ``input``, with line editing, when standard output is the
    terminal too, else on standard error, so that standard output keeps only the answers."""
    if not sys.stdin.isatty():
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None
    try:
        if sys.stdout.isatty():
            return input(prompt)
        sys.stderr.write(prompt)
        sys.stderr.flush()
        return input()
    except EOFError:
        sys.stderr.write("\n")
        return None


def _interactive(greeting: str, ask: Any) -> int:
    """Read lines until the end of input or Ctrl-C (both exit 0), answering each non-blank one."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    print(greeting, file=sys.stderr)
    try:
        while True:
            line = _read_line("> ")
            if line is None:
                return 0
            if line.strip():
                ask(line)
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.write("\n")
        return 0


def _stream_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"stream_options": {"include_usage": True}} if args.stats else {}


def cmd_chat(args: argparse.Namespace) -> int:
    client, model = _connect(args)
    conversation: list[dict[str, str]] = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})

    def ask(message: str) -> None:
        conversation.append({"role": "user", "content": message})
        try:
            reply = Answer(args.stats).show(client.stream("/chat/completions", {
                "model": model, "messages": conversation, **_stream_options(args)}), "delta")
        except BaseException:
            conversation.pop()
            raise
        conversation.append({"role": "assistant", "content": reply})

    if args.quick is not None:
        ask(args.quick)
        return 0
    return _interactive(f"Using model: {model}. Enter a message (Ctrl-D or Ctrl-C to end).", ask)


def cmd_complete(args: argparse.Namespace) -> int:
    client, model = _connect(args)
    body: dict[str, Any] = {"model": model, **_stream_options(args)}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens

    def ask(prompt: str) -> None:
        Answer(args.stats).show(client.stream("/completions", {**body, "prompt": prompt}), "text")

    if args.quick is not None:
        ask(args.quick)
        return 0
    return _interactive(f"Using model: {model}. Enter a prompt to complete (Ctrl-D or Ctrl-C to end).", ask)


def cmd_collect_env(args: argparse.Namespace) -> int:
    from sparrow.entrypoints.collect_env import print_environment

    return print_environment(getattr(args, "environ_at_start", None))
