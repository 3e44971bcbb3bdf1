"""The `sparrow` command: generate, serve, bench, plugins, worker.

A mistake by the user (a bad flag value, a missing model or weight file, an unknown scheduler or
device, a busy port) ends the command with one line, ``sparrow: error: <message>``, and exit
status 2 (1 for failures at run time); ``--debug`` adds the traceback. argparse's own mistakes
(an unknown flag, a value of the wrong type) are that one line too, without the usage block.

``--log-level`` governs every process: the engine core and the worker ranks read it from
``SPARROW_LOGGING_LEVEL``, which the command sets before any of them starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
import types
from typing import Any, Literal, NoReturn, Union, get_args, get_origin

from sparrow.entrypoints.cli_errors import (
    EXIT_INTERRUPTED,
    EXIT_RUNTIME_FAILURE,
    EXIT_USER_ERROR,
    describe_error,
    explain_vllm_flags,
)
from sparrow.utils.argparse_utils import FlexibleArgumentParser

ENV_LOGGING_LEVEL = "SPARROW_LOGGING_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Engine arguments set by Sparrow itself between its processes: accepted, never shown in --help.
HIDDEN_ENGINE_ARGS = frozenset({"data_parallel_rank"})
DEFAULT_PROMPT = "Once upon a time"


class ArgumentParser(FlexibleArgumentParser):
    """vLLM's flexible spellings (``--max_model_len``, ``--speculative-config.method``, ``--config
    FILE.yaml``; see ``sparrow.utils.argparse_utils``), and a usage mistake is one line, like every
    other user mistake: ``sparrow: error: <message>`` and status 2, without argparse's usage block
    (``--help`` still prints it). Subcommands' parsers are of this class too (``add_subparsers``
    makes its parsers of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"sparrow: error: {explain_vllm_flags(message)} (see `{self.prog} --help`)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already states its default (a
    default of None or False means "not set" and is explained by the text itself)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


# -- engine arguments ---------------------------------------------------------------------------
def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, skip: tuple[str, ...] = ()) -> None:
    """Every EngineConfig field as --kebab-case, generated so flags never drift from the config;
    the field's description is the help text. Flags default to None: only what the user sets is
    passed on, and the config supplies the rest. Given an argument group (vLLM's examples pass
    one to ``EngineArgs.add_cli_args``), the flags go into that group."""
    from sparrow.config import EngineConfig

    group = (parser if isinstance(parser, argparse._ArgumentGroup)
             else parser.add_argument_group("engine arguments"))
    for section in EngineConfig.sections().values():
        for name, field in section.model_fields.items():
            if name in skip:
                continue
            flag = "--" + name.replace("_", "-")
            if name in HIDDEN_ENGINE_ARGS:
                help_text = argparse.SUPPRESS
            else:
                help_text = (field.description or name.replace("_", " ")).replace("%", "%%")
                default = field.get_default(call_default_factory=True)
                if "(default:" not in help_text:
                    shown = json.dumps(default) if isinstance(default, dict) else default
                    help_text = help_text.rstrip(".") + f" (default: {shown})."
            # `int | None` -> [int]; `Literal["uni", "mp"] | None` -> [Literal["uni", "mp"]]
            kinds = [field.annotation]
            if get_origin(field.annotation) in (Union, types.UnionType):
                kinds = [arg for arg in get_args(field.annotation) if arg is not type(None)]
            if kinds == [bool]:  # `bool` and `bool | None`
                group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            elif get_origin(kinds[0]) is Literal:
                group.add_argument(flag, dest=name, choices=list(get_args(kinds[0])), default=None, help=help_text)
            elif get_origin(kinds[0]) is list:
                group.add_argument(flag, dest=name, nargs="+", type=_text, default=None, metavar="NAME",
                                   help=help_text)
            elif dict in kinds or get_origin(kinds[0]) is dict:
                group.add_argument(flag, dest=name, type=_json_object, default=None, metavar="JSON", help=help_text)
            elif int in kinds:
                group.add_argument(flag, dest=name, type=int, default=None, help=help_text)
            elif float in kinds:
                group.add_argument(flag, dest=name, type=float, default=None, help=help_text)
            else:
                group.add_argument(flag, dest=name, type=_text, default=None, help=help_text)


def _text(value: str) -> str:
    """A text engine argument: empty would be taken for the default (``--served-model-name ""``
    served under the model's name), so it is refused."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user actually set."""
    from sparrow.config import EngineConfig

    return {name: getattr(args, name) for name in EngineConfig.field_names()
            if getattr(args, name, None) is not None}


def merge_model_arg(kwargs: dict[str, Any], model_pos: str | None) -> dict[str, Any]:
    """The positional MODEL and --model are one argument; naming two different models is an error."""
    from sparrow.config import ConfigError

    if model_pos is not None:
        if kwargs.get("model") not in (None, model_pos):
            raise ConfigError(f"invalid engine argument 'model': MODEL {model_pos!r} and --model "
                              f"{kwargs['model']!r} disagree; give one")
        kwargs["model"] = model_pos
    return kwargs


# -- commands -----------------------------------------------------------------------------------
# What `sparrow generate` samples with where neither a flag nor the model's generation config says.
GENERATE_DEFAULTS = {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def cmd_generate(args: argparse.Namespace) -> int:
    from sparrow import LLM, RequestOutputKind, SamplingParams

    kwargs = merge_model_arg(engine_kwargs(args), args.model_pos)
    # A flag given wins; then the model's generation config (--generation-config,
    # --override-generation-config); then this command's own defaults (greedy, 32 tokens).
    flags = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k}
    given = {name: value for name, value in flags.items() if value is not None}
    fixed = {"seed": args.sampling_seed, "ignore_eos": args.ignore_eos, "output_kind": RequestOutputKind.DELTA}
    # Checked before the engine starts, so that a bad sampling flag is reported without loading a model.
    SamplingParams(**given, **fixed)
    prompts = args.prompt or [DEFAULT_PROMPT]
    with LLM(**kwargs) as llm:
        params = SamplingParams(**{**GENERATE_DEFAULTS, **llm.llm_engine.default_sampling_params, **given}, **fixed)
        stream_generate(llm.llm_engine, prompts, params, sys.stdout)
    return 0


def stream_generate(engine: Any, prompts: list[str], params: Any, out: Any) -> None:
    """Print each prompt followed by its continuation, as it is generated.

    One prompt streams its text token by token. Several print whole, each as soon as it
    finishes (streams of several requests interleaved would be unreadable).
    """
    prompt_of = {}  # request id -> prompt text
    for index, prompt in enumerate(prompts):
        request_id = f"generate-{index}"
        engine.add_request(request_id, prompt, params)
        prompt_of[request_id] = prompt
    streaming = len(prompts) == 1
    if streaming:
        out.write(prompts[0])
        out.flush()
    texts: dict[str, list[str]] = {request_id: [] for request_id in prompt_of}  # request id -> text deltas so far
    while engine.has_unfinished_requests():
        for output in engine.step():
            delta = output.outputs[0].text if output.outputs else ""
            if streaming:
                out.write(delta)
            else:
                texts[output.request_id].append(delta)
            if output.finished:
                if streaming:
                    out.write("\n")
                else:
                    prompt = prompt_of[output.request_id]
                    out.write(f"--- {prompt!r}\n{prompt}{''.join(texts[output.request_id])}\n")
            out.flush()


def cmd_plugins(args: argparse.Namespace) -> int:
    from sparrow.conformance.cli import print_op_table, refuse_check_flags, run_check_command
    from sparrow.platforms import available_platforms
    from sparrow.plugins import get_plugin_manager, get_registry

    if args.check is not None:
        return run_check_command(args)
    refuse_check_flags(args)
    pm = get_plugin_manager()
    print("plugins:")
    for name, plugin in pm.list_name_plugin():
        hooks = sorted(impl.name for impl in pm.get_hookcallers(plugin) or [])
        print(f"  {name}: {', '.join(hooks)}")
    registry = get_registry(pm)
    print("platforms:")
    for name, path in available_platforms().items():
        entry = registry.platforms[name]
        state = "present" if path else "absent"
        print(f"  {name} (priority {entry.priority}, {state}, from {entry.plugin})")
    print("schedulers:", ", ".join(sorted(registry.schedulers)))
    print("kv connectors:", ", ".join(sorted(registry.kv_connectors)) or "none")
    print("kv eviction policies:", ", ".join(sorted(registry.kv_eviction_policies)) or "none")
    from sparrow.model_registry import ModelRegistry

    print("architectures:", ", ".join(ModelRegistry.get_supported_archs()))
    print("logits processors:", ", ".join(sorted(registry.logits_processors)))
    print("tool parsers:", ", ".join(sorted(registry.tool_parsers)) or "none")
    print("reasoning parsers:", ", ".join(sorted(registry.reasoning_parsers)) or "none")
    print("model loaders (load_format):", ", ".join(sorted(registry.model_loaders)) or "none")
    print("quantization methods:", ", ".join(sorted(registry.quantization_methods)) or "none")
    print("device communicators:", ", ".join(sorted(registry.device_communicators)) or "none")
    print("speculative proposers (speculative_config method):", ", ".join(sorted(registry.spec_proposers)) or "none")
    print("stat loggers:", ", ".join(sorted(registry.stat_loggers)) or "none")
    print_op_table(registry, list(registry.platforms))
    return 0


# -- the parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from sparrow import __version__

    parser = ArgumentParser(prog="sparrow", description="Sparrow: a small, pluggable LLM inference engine",
                            formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_common_options(parser, argparse.SUPPRESS)
    parser.set_defaults(log_level=None, debug=False, default_log_level="WARNING")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one or more prompts, printed as it is generated",
                         description="Generate text for each prompt and print the prompt with its continuation "
                                     "(one prompt streams as tokens arrive; several print as each finishes).")
    gen.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                     help="local model directory, the same as --model (default: built-in sparrow-tiny)")
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--prompt", action="append",
                          help=f"prompt text; repeat for several (default: {DEFAULT_PROMPT!r})")
    # Unset flags take the model's generation config, then GENERATE_DEFAULTS.
    sampling.add_argument("--max-tokens", type=int, default=None,
                          help="most tokens to generate per prompt (default: the generation config's max_new_tokens, "
                               "else 32)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="sampling temperature; 0 is greedy (default: the generation config's, else 0)")
    sampling.add_argument("--top-p", type=float, default=None,
                          help="nucleus sampling: keep this probability mass (default: the generation config's, "
                               "else 1)")
    sampling.add_argument("--top-k", type=int, default=None,
                          help="keep the k most likely tokens; 0 keeps all (default: the generation config's, else 0)")
    sampling.add_argument("--sampling-seed", type=int, default=None,
                          help="per-request sampling seed (default: none, the engine's --seed drives sampling)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token (default: stop there)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    plugins = sub.add_parser("plugins", help="list plugins, hooks, platforms, schedulers, connectors, architectures "
                                              "and ops; --check DEVICE runs the conformance suite")
    from sparrow.conformance.cli import add_check_arguments

    add_check_arguments(plugins)
    plugins.set_defaults(func=cmd_plugins)

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, ablate, trace, sim")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    from sparrow.bench import latency, synthetic, throughput

    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    synthetic.add_parser(bench_sub)
    _optional_parsers(sub, bench_sub)
    # Long-running services log their start-up by default; one-shot commands keep stdout clean.
    for name in ("serve", "worker"):
        if name in sub.choices:
            sub.choices[name].set_defaults(default_log_level="INFO")
    for child in _sub_parsers(parser):
        _add_common_options(child, argparse.SUPPRESS)
    return parser


def _add_common_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """--log-level and --debug, accepted before or after the subcommand. Subcommands default to
    SUPPRESS so that an option given before the subcommand is not reset by the subcommand."""
    parser.formatter_class = HelpFormatter
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default, metavar="LEVEL",
                        help=f"log level of every Sparrow process, {', '.join(LOG_LEVELS)} (default: "
                             f"${ENV_LOGGING_LEVEL}, else WARNING; INFO for serve and worker)")
    parser.add_argument("--debug", action="store_true", default=default,
                        help="on an error, print the traceback too (default: one line)")


def _sub_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.append(child)
                found.extend(_sub_parsers(child))
    return found


def _optional_parsers(sub: Any, bench_sub: Any) -> None:
    """Subcommands defined next to their implementations. Only their parsers are imported here
    (never the server stack), since every command builds the whole parser, --version included."""
    from sparrow.entrypoints.openai.cli_args import add_serve_parser
    from sparrow.entrypoints.openai.run_batch_args import add_run_batch_parser

    add_serve_parser(sub)
    add_run_batch_parser(sub)
    from sparrow.entrypoints.cli_clients import add_client_parsers

    add_client_parsers(sub)
    try:
        from sparrow.bench.serve_args import add_bench_serve_parser
    except ImportError:
        pass
    else:
        add_bench_serve_parser(bench_sub)
    from sparrow.executor.remote_worker import add_worker_parser

    add_worker_parser(sub)
    try:
        from sparrow.bench.ablate import add_parser as add_ablate_parser
    except ImportError:
        pass
    else:
        add_ablate_parser(bench_sub)
    from sparrow.sim.bench import add_parser as add_sim_parser

    add_sim_parser(bench_sub)


# -- logging ------------------------------------------------------------------------------------
def configure_logging(args: argparse.Namespace) -> str:
    """Set the log level of this process and, through the environment, of every process it starts.
    A value of ``$SPARROW_LOGGING_LEVEL`` that is not a level is a ValueError naming the variable,
    even under ``--log-level`` (never a value accepted and ignored)."""
    from_env = os.environ.get(ENV_LOGGING_LEVEL)
    if from_env and from_env.upper() not in LOG_LEVELS:
        raise ValueError(f"{ENV_LOGGING_LEVEL}={from_env!r} is not a log level; use one of {', '.join(LOG_LEVELS)} "
                         "(or unset it)")
    level = (args.log_level or from_env or args.default_log_level).upper()
    os.environ[ENV_LOGGING_LEVEL] = level
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return level


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if args.command == "bench":
            from sparrow.bench.outputs import check_outputs

            check_outputs(args)  # a report that cannot be written fails now, not after the run
        result = args.func(args)
    except KeyboardInterrupt:
        print("sparrow: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`sparrow generate | head -1`): nothing left to tell anyone.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return EXIT_RUNTIME_FAILURE
    except Exception as exc:  # noqa: BLE001 - classified below; bugs are re-raised with their traceback
        described = describe_error(exc)
        if described is None:
            raise
        message, status = described
        if args.debug:
            traceback.print_exc()
        print(f"sparrow: error: {message}", file=sys.stderr)
        return status
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
