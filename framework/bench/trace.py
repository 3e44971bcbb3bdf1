"""Request traces: a JSONL file of timed requests that ``sparrow bench serve --trace`` and
``sparrow bench ablate --trace`` replay, and synthetic generators for two workloads.

One JSON object per line (blank lines are skipped), with these keys:

- ``arrival_s`` (number, required): seconds after the trace starts; >= 0, non-decreasing.
- ``output_len`` (int >= 1, required): tokens to generate (sent as ``max_tokens`` with ``ignore_eos``).
- ``prompt_len`` (int >= 1) or ``prompt_token_ids`` (list of ints >= 0): exactly one of the two.
  With ``prompt_len`` the replayer draws token ids (``prompt_tokens``).
- ``prefix_group`` (string, optional) and ``prefix_len`` (int >= 0, default 0, at most the prompt's
  length): requests of one group start with the same ``prefix_len`` tokens, those of the group's
  latest earlier request (a shared system prompt, or a conversation's previous context).
- ``priority`` (int, default 0): sent as the request's ``priority`` (lower is served first).

Any other key is refused, so a misspelt key cannot silently fall back to a default.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEYS = ("arrival_s", "output_len", "prompt_len", "prompt_token_ids", "prefix_group", "prefix_len", "priority")
KINDS = ("shared-system-prompt", "multi-turn")
# The tiny tokenizer keeps its special tokens at the top of the vocabulary: drawn ids stay below.
SPECIAL_TOKEN_MARGIN = 16


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds after the trace starts
    output_len: int  # max_tokens, sent with ignore_eos
    prompt_len: int | None = None  # tokens, when prompt_token_ids is None
    prompt_token_ids: list[int] | None = None
    prefix_group: str | None = None  # requests of one group share their first prefix_len tokens
    prefix_len: int = 0
    priority: int = 0

    def __post_init__(self) -> None:
        arrival = self.arrival_s
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
            raise ValueError(f"'arrival_s' must be a finite number of seconds, got {arrival!r}")
        if arrival < 0:
            raise ValueError(f"'arrival_s' must be >= 0, got {arrival!r}")
        object.__setattr__(self, "arrival_s", float(arrival))
        if not _is_int(self.output_len) or self.output_len < 1:
            raise ValueError(f"'output_len' must be an integer >= 1, got {self.output_len!r}")
        if (self.prompt_len is None) == (self.prompt_token_ids is None):
            raise ValueError("exactly one of 'prompt_len' and 'prompt_token_ids' must be given, "
                             f"got {'both' if self.prompt_len is not None else 'neither'}")
        if self.prompt_len is not None and (not _is_int(self.prompt_len) or self.prompt_len < 1):
            raise ValueError(f"'prompt_len' must be an integer >= 1, got {self.prompt_len!r}")
        if self.prompt_token_ids is not None:
            ids = self.prompt_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"'prompt_token_ids' must be a non-empty list of token ids, got {ids!r}")
            bad = next((i for i, t in enumerate(ids) if not _is_int(t) or t < 0), None)
            if bad is not None:
                raise ValueError(f"'prompt_token_ids'[{bad}] must be an integer >= 0, got {ids[bad]!r}")
            object.__setattr__(self, "prompt_token_ids", list(ids))
        if self.prefix_group is not None and (not isinstance(self.prefix_group, str) or not self.prefix_group):
            raise ValueError(f"'prefix_group' must be a non-empty string, got {self.prefix_group!r}")
        if not _is_int(self.prefix_len) or self.prefix_len < 0:
            raise ValueError(f"'prefix_len' must be an integer >= 0, got {self.prefix_len!r}")
        if self.prefix_len > 0 and self.prefix_group is None:
            raise ValueError(f"'prefix_len' is {self.prefix_len} but 'prefix_group' is not set")
        if self.prefix_len > self.num_prompt_tokens:
            raise ValueError(f"'prefix_len' {self.prefix_len} is longer than the prompt "
                             f"({self.num_prompt_tokens} tokens)")
        if not _is_int(self.priority):
            raise ValueError(f"'priority' must be an integer, got {self.priority!r}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else int(self.prompt_len)

    def to_json(self) -> dict[str, Any]:
        """The request as one trace line: keys at their default values are left out."""
        line: dict[str, Any] = {"arrival_s": self.arrival_s}
        if self.prompt_token_ids is not None:
            line["prompt_token_ids"] = list(self.prompt_token_ids)
        else:
            line["prompt_len"] = self.prompt_len
        line["output_len"] = self.output_len
        if self.prefix_group is not None:
            line["prefix_group"] = self.prefix_group
            line["prefix_len"] = self.prefix_len
        if self.priority:
            line["priority"] = self.priority
        return line


def parse_request(obj: Any) -> TraceRequest:
    """One decoded trace line to a request; ValueError names the field."""
    if not isinstance(obj, dict):
        raise ValueError(f"a trace line must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; the keys are {', '.join(KEYS)}")
    for key in ("arrival_s", "output_len"):
        if key not in obj:
            raise ValueError(f"'{key}' is required")
    return TraceRequest(**obj)


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace; a ValueError names the file, the line number and the field."""
    path = Path(path)
    requests: list[TraceRequest] = []
    previous = 0.0
    with path.open(encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {number}: not valid JSON ({exc.msg})") from None
            try:
                request = parse_request(obj)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path} line {number}: {exc}") from None
            if request.arrival_s < previous:
                raise ValueError(f"{path} line {number}: 'arrival_s' {request.arrival_s} is earlier than the "
                                 f"previous request's {previous}; arrival times must be non-decreasing")
            previous = request.arrival_s
            requests.append(request)
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return requests


def save_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write requests as JSONL, one object per line (they must be in arrival order)."""
    lines = []
    previous = 0.0
    for index, request in enumerate(requests):
        if not isinstance(request, TraceRequest):
            raise ValueError(f"request {index} is a {type(request).__name__}, not a TraceRequest")
        if request.arrival_s < previous:
            raise ValueError(f"request {index}: 'arrival_s' {request.arrival_s} is earlier than the previous "
                             f"request's {previous}; sort the requests by arrival time")
        previous = request.arrival_s
        lines.append(json.dumps(request.to_json(), separators=(", ", ": ")))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def prompt_tokens(requests: Iterable[TraceRequest], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Deterministic prompt token ids for each request, in order.

    Explicit ``prompt_token_ids`` are kept. Otherwise a request of a ``prefix_group`` starts with the
    first ``prefix_len`` tokens of its group's latest earlier prompt (extended with fresh ids where that
    prompt is shorter: in a conversation, the part standing for the previous answer), then fresh ids.
    Fresh ids are below ``vocab_size - 16``.
    """
    if not _is_int(vocab_size) or vocab_size <= SPECIAL_TOKEN_MARGIN:
        raise ValueError(f"'vocab_size' must be an integer > {SPECIAL_TOKEN_MARGIN}, got {vocab_size!r}")
    rng = random.Random(seed)
    population = range(vocab_size - SPECIAL_TOKEN_MARGIN)
    latest: dict[str, list[int]] = {}  # group -> its latest prompt, the prefix source of the next
    out: list[list[int]] = []
    for request in requests:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        else:
            prefix: list[int] = []
            if request.prefix_group is not None and request.prefix_len:
                prefix = latest.get(request.prefix_group, [])[:request.prefix_len]
                prefix = prefix + rng.choices(population, k=request.prefix_len - len(prefix))
            ids = prefix + rng.choices(population, k=request.num_prompt_tokens - len(prefix))
        if request.prefix_group is not None:
            latest[request.prefix_group] = ids
        out.append(ids)
    return out


def synthesize(kind: str, num_requests: int, seed: int = 0, **options: Any) -> list[TraceRequest]:
    """A synthetic trace of ``kind`` (one of KINDS), deterministic for ``seed``; options in synthetic.py."""
    from sparrow.bench.synthetic import GENERATORS

    if kind not in GENERATORS:
        raise ValueError(f"'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    if not _is_int(num_requests) or num_requests < 1:
        raise ValueError(f"'num_requests' must be an integer >= 1, got {num_requests!r}")
    return GENERATORS[kind](num_requests, random.Random(seed), **options)
