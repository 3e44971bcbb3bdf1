"""The `sparrow` command: generate, serve, bench, plugins."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Every EngineConfig field as --kebab-case, generated so flags never drift from the config."""
    from sparrow.config import EngineConfig

    group = parser.add_argument_group("engine arguments")
    for section_name, section in EngineConfig.sections().items():
        for name, field in section.model_fields.items():
            if name in skip:
                continue
            flag = "--" + name.replace("_", "-")
            annotation = str(field.annotation)
            help_text = field.description or f"{section_name} setting"
            if field.annotation is bool:
                group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            elif "dict" in annotation:
                group.add_argument(flag, dest=name, type=json.loads, default=None, help=help_text + " (JSON)")
            elif "int" in annotation and "float" not in annotation:
                group.add_argument(flag, dest=name, type=int, default=None, help=help_text)
            elif "float" in annotation:
                group.add_argument(flag, dest=name, type=float, default=None, help=help_text)
            else:
                group.add_argument(flag, dest=name, default=None, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user actually set."""
    from sparrow.config import EngineConfig

    return {name: getattr(args, name) for name in EngineConfig.field_names()
            if getattr(args, name, None) is not None}


def cmd_generate(args: argparse.Namespace) -> int:
    from sparrow import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    if args.model_pos is not None:
        kwargs["model"] = args.model_pos
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["Once upon a time"]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        if len(prompts) > 1:
            print(f"--- {output.prompt!r}")
        print(output.prompt + output.outputs[0].text)
    llm.shutdown()
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from sparrow.platforms import available_platforms
    from sparrow.plugins import get_plugin_manager, get_registry

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
    print("architectures:", ", ".join(sorted(registry.architectures)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparrow", description="Sparrow: a small, pluggable LLM inference engine")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                     help="local model directory (default: built-in sparrow-tiny)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen, skip=("model",))
    gen.set_defaults(func=cmd_generate)

    plugins = sub.add_parser("plugins", help="list plugins, hooks, platforms, schedulers, connectors, architectures")
    plugins.set_defaults(func=cmd_plugins)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from sparrow.bench import throughput

    throughput.add_parser(bench_sub)
    _optional_parsers(sub, bench_sub)
    return parser


def _optional_parsers(sub: Any, bench_sub: Any) -> None:
    """Subcommands whose modules may pull in the server stack."""
    try:
        from sparrow.entrypoints.openai.api_server import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    try:
        from sparrow.bench.serve import add_bench_serve_parser
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    result = args.func(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
