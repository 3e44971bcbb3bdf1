"""Compare two lm-evaluation-harness runs request by request (their --log_samples files).

    python examples/lm_eval/compare.py RUN_A RUN_B [--atol 1e-4]

RUN_A and RUN_B are --output_path directories. For every task both ran, each request's answer is
compared: loglikelihoods within --atol, is-greedy flags and generated texts exactly. Prints one
line per task and exits 1 when anything differs. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_SAMPLES = re.compile(r"samples_(?P<task>.+)_\d{4}-\d{2}-\d{2}T[\d\-.]+\.jsonl$")


def latest_samples(run_dir: Path) -> dict[str, Path]:
    """task -> its newest samples file under ``run_dir``."""
    found: dict[str, Path] = {}
    for path in sorted(run_dir.rglob("samples_*.jsonl")):  # timestamps sort: the last is the newest
        match = _SAMPLES.search(path.name)
        if match:
            found[match.group("task")] = path
    return found


def answers(path: Path) -> dict[int, list]:
    """doc_id -> the request answers of that document, as lm-eval logged them."""
    with path.open() as lines:
        return {sample["doc_id"]: sample["resps"] for sample in map(json.loads, lines)}


def flatten(resps: list) -> list[str]:
    # resps: one list per request; a loglikelihood answer is [logprob, is_greedy], a generation a string.
    flat: list[str] = []
    for item in resps:
        flat.extend(flatten(item) if isinstance(item, list) else [str(item)])
    return flat


def compare_task(a: dict[int, list], b: dict[int, list], atol: float) -> str:
    """One line: how many loglikelihoods and texts/flags were compared, the largest loglikelihood
    difference, and how many answers differ (beyond ``atol`` for loglikelihoods)."""
    if a.keys() != b.keys():
        raise SystemExit(f"the runs scored different documents: {sorted(a.keys() ^ b.keys())[:10]}")
    numbers, texts, worst, differing = 0, 0, 0.0, 0
    for doc_id in sorted(a):
        left, right = flatten(a[doc_id]), flatten(b[doc_id])
        if len(left) != len(right):
            differing += 1
            continue
        for x, y in zip(left, right):
            try:
                delta = abs(float(x) - float(y))
            except ValueError:  # a generated text or an is-greedy flag: equal or not
                texts += 1
                differing += x != y
                continue
            numbers += 1
            worst = max(worst, delta)
            differing += not delta <= atol
    scores = f"{numbers} loglikelihoods (max |difference| {worst:.1e}), " if numbers else ""
    return f"{scores}{texts} texts/flags, {differing} differ" + (" (FAIL)" if differing else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--atol", type=float, default=1e-4, help="loglikelihood tolerance (default: 1e-4)")
    args = parser.parse_args()
    samples_a, samples_b = latest_samples(args.run_a), latest_samples(args.run_b)
    tasks = sorted(samples_a.keys() & samples_b.keys())
    if not tasks:
        raise SystemExit(f"no task has samples in both runs (did both use --log_samples?): "
                         f"{sorted(samples_a)} vs {sorted(samples_b)}")
    failed = False
    for task in tasks:
        line = compare_task(answers(samples_a[task]), answers(samples_b[task]), args.atol)
        failed |= line.endswith("(FAIL)")
        print(f"{task}: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
