"""Synthetic request traces (``sparrow bench trace``), deterministic for a seed.

``shared-system-prompt``: requests arrive as a Poisson process at ``request_rate``; each picks one of
``num_system_prompts`` system prompts of ``system_prompt_len`` tokens (its ``prefix_group``, shared as
``prefix_len``) followed by a unique suffix of ``suffix_len_min``..``suffix_len_max`` tokens.

``multi-turn``: conversations of ``turns_min``..``turns_max`` turns. Turn k's prompt is the previous
turns' prompts and answers plus a new user message of ``user_len_min``..``user_len_max`` tokens, so its
``prefix_group`` is the conversation and its ``prefix_len`` the previous turn's prompt plus output.
Conversations start as a Poisson process at ``request_rate / mean turns`` (requests then arrive at about
``request_rate`` overall); a turn arrives an exponential think time (mean ``think_time_s``, counted from
the previous turn's arrival since a trace cannot know when the answer ends) after the previous one. A
conversation ends early rather than send a prompt longer than ``max_prompt_len``.

Both: ``output_len_min``..``output_len_max`` output tokens, ``num_priorities`` priority levels (0 first).
All ranges are inclusive and drawn uniformly.
"""

from __future__ import annotations

import argparse
import math
import random
from typing import Any, Callable

from sparrow.bench.outputs import RULE as OUTPUT_RULE
from sparrow.bench.trace import KINDS, TraceRequest, save_trace

COMMON = {"request_rate": 4.0, "output_len_min": 16, "output_len_max": 128, "num_priorities": 1}
OPTIONS: dict[str, dict[str, Any]] = {
    "shared-system-prompt": {**COMMON, "num_system_prompts": 4, "system_prompt_len": 512,
                             "suffix_len_min": 16, "suffix_len_max": 256},
    "multi-turn": {**COMMON, "turns_min": 2, "turns_max": 6, "user_len_min": 16, "user_len_max": 128,
                   "think_time_s": 5.0, "max_prompt_len": None},
}
# Options that may be 0 (the rest of the integer options must be >= 1).
_MAY_BE_ZERO = {"think_time_s"}


def _quoted(name: str) -> str:
    return f"'{name}'"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _options(kind: str, given: dict[str, Any], show: Callable[[str], str] = _quoted) -> dict[str, Any]:
    """The options of ``kind``: its defaults updated with ``given``, checked; ValueError naming the
    option as ``show`` writes it (Python's ``'name'``, or the command line's ``--name``)."""
    defaults = OPTIONS[kind]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"option(s) {', '.join(map(show, unknown))} do not apply to kind {kind!r}; "
                         f"its options are {', '.join(map(show, defaults))}")
    opts = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    for name, value in opts.items():
        if value is None:
            continue
        if name in ("request_rate", "think_time_s"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{show(name)} must be a number, got {value!r}")
            if value < 0 or (value == 0 and name not in _MAY_BE_ZERO):
                raise ValueError(f"{show(name)} must be {'>= 0' if name in _MAY_BE_ZERO else '> 0'}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{show(name)} must be an integer >= 1, got {value!r}")
    for low in [name for name in opts if name.endswith("_min")]:
        high = low[:-4] + "_max"
        if opts[low] > opts[high]:
            raise ValueError(f"{show(low)} ({opts[low]}) is larger than {show(high)} ({opts[high]})")
    if kind == "multi-turn" and opts["max_prompt_len"] is not None and opts["max_prompt_len"] < opts["user_len_max"]:
        raise ValueError(f"{show('max_prompt_len')} ({opts['max_prompt_len']}) is shorter than "
                         f"{show('user_len_max')} ({opts['user_len_max']}): a first turn might not fit")
    return opts


def _gap(rng: random.Random, rate: float) -> float:
    return 0.0 if rate == math.inf else rng.expovariate(rate)


def shared_system_prompt(num_requests: int, rng: random.Random, **given: Any) -> list[TraceRequest]:
    opts = _options("shared-system-prompt", given)
    requests = []
    arrival = 0.0
    for _ in range(num_requests):
        group = rng.randrange(opts["num_system_prompts"])
        suffix = rng.randint(opts["suffix_len_min"], opts["suffix_len_max"])
        requests.append(TraceRequest(
            arrival_s=round(arrival, 6), output_len=rng.randint(opts["output_len_min"], opts["output_len_max"]),
            prompt_len=opts["system_prompt_len"] + suffix, prefix_group=f"system-{group}",
            prefix_len=opts["system_prompt_len"], priority=rng.randrange(opts["num_priorities"])))
        arrival += _gap(rng, opts["request_rate"])
    return requests


def multi_turn(num_requests: int, rng: random.Random, **given: Any) -> list[TraceRequest]:
    opts = _options("multi-turn", given)
    conversation_rate = opts["request_rate"] / ((opts["turns_min"] + opts["turns_max"]) / 2)
    think = opts["think_time_s"]
    turns: list[tuple[float, int, int, TraceRequest]] = []
    start = 0.0
    conversation = 0
    while len(turns) < num_requests:
        priority = rng.randrange(opts["num_priorities"])
        context = 0  # tokens of the previous turns' prompts and answers
        arrival = start
        for turn in range(rng.randint(opts["turns_min"], opts["turns_max"])):
            prompt_len = context + rng.randint(opts["user_len_min"], opts["user_len_max"])
            output_len = rng.randint(opts["output_len_min"], opts["output_len_max"])
            if opts["max_prompt_len"] is not None and prompt_len > opts["max_prompt_len"]:
                break
            at = round(arrival, 6)
            turns.append((at, conversation, turn, TraceRequest(
                arrival_s=at, output_len=output_len, prompt_len=prompt_len,
                prefix_group=f"conv-{conversation}", prefix_len=context, priority=priority)))
            if len(turns) == num_requests:
                break
            context = prompt_len + output_len
            arrival += rng.expovariate(1.0 / think) if think > 0 else 0.0
        conversation += 1
        start += _gap(rng, conversation_rate)
    turns.sort(key=lambda item: item[:3])
    return [request for *_, request in turns]


GENERATORS: dict[str, Callable[..., list[TraceRequest]]] = {
    "shared-system-prompt": shared_system_prompt, "multi-turn": multi_turn,
}


def run(args: argparse.Namespace) -> int:
    from sparrow.bench.trace import synthesize

    given = {name: getattr(args, name) for name in sorted(set().union(*OPTIONS.values()))
             if getattr(args, name) is not None}
    misplaced = [_flag(name) for name in given if name not in OPTIONS[args.kind]]
    if misplaced:
        verb = "does" if len(misplaced) == 1 else "do"
        raise ValueError(f"{', '.join(misplaced)} {verb} not apply to --kind {args.kind} (its options: "
                         f"{', '.join(map(_flag, OPTIONS[args.kind]))})")
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be an integer >= 1, got {args.num_requests}")
    _options(args.kind, given, show=_flag)  # the same checks synthesize makes, naming the flags
    requests = synthesize(args.kind, args.num_requests, args.seed, **given)
    save_trace(args.output, requests)
    groups = {r.prefix_group for r in requests if r.prefix_group is not None}
    shared = sum(r.prefix_len for r in requests)
    total = sum(r.num_prompt_tokens for r in requests)
    print(f"wrote {args.output}: {len(requests)} requests over {requests[-1].arrival_s:.1f} s, "
          f"{len(groups)} prefix groups, {total} prompt tokens ({shared / total:.0%} in shared prefixes)")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sparrow bench trace`` to the ``bench`` subcommands."""
    parser = subparsers.add_parser("trace", help="write a synthetic request trace (JSONL) for bench serve/ablate")
    parser.add_argument("--kind", choices=KINDS, required=True, help="the workload to synthesize")
    parser.add_argument("--num-requests", type=int, default=200, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0, help="seed of lengths, groups and arrival times")
    parser.add_argument("-o", "--output", required=True, help=f"the JSONL file to write ({OUTPUT_RULE})")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="requests per second, Poisson arrivals ('inf': all at 0; default 4)")
    parser.add_argument("--output-len-min", type=int, default=None, help="fewest output tokens (default 16)")
    parser.add_argument("--output-len-max", type=int, default=None, help="most output tokens (default 128)")
    parser.add_argument("--num-priorities", type=int, default=None, help="priority levels drawn (default 1: all 0)")
    group = parser.add_argument_group("shared-system-prompt")
    group.add_argument("--num-system-prompts", type=int, default=None, help="distinct system prompts (default 4)")
    group.add_argument("--system-prompt-len", type=int, default=None, help="tokens per system prompt (default 512)")
    group.add_argument("--suffix-len-min", type=int, default=None, help="shortest unique suffix (default 16)")
    group.add_argument("--suffix-len-max", type=int, default=None, help="longest unique suffix (default 256)")
    group = parser.add_argument_group("multi-turn")
    group.add_argument("--turns-min", type=int, default=None, help="fewest turns per conversation (default 2)")
    group.add_argument("--turns-max", type=int, default=None, help="most turns per conversation (default 6)")
    group.add_argument("--user-len-min", type=int, default=None, help="shortest new user message (default 16)")
    group.add_argument("--user-len-max", type=int, default=None, help="longest new user message (default 128)")
    group.add_argument("--think-time-s", type=float, default=None, help="mean seconds between turns (default 5)")
    group.add_argument("--max-prompt-len", type=int, default=None,
                       help="a conversation ends before a longer prompt (default: no limit)")
    parser.set_defaults(func=run)
    return parser
