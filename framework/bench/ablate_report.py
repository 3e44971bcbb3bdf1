"""The reports of `sparrow bench ablate`: a markdown table and a PNG chart of the grid's points.

A simulated run's table names the simulated card instead of this machine and carries no date, so
two runs with the same seed write identical tables (results.json keeps the date).

The table and results.json are rewritten after every point, so a grid stopped half-way (Ctrl-C, a
crash, a killed machine) keeps what it measured; a point that failed is a row saying why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = (
    # (header, key, format)
    ("req/s", "request_throughput", "{:.2f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
    ("mean TTFT (s)", "mean_ttft_s", "{:.3f}"),
    ("p99 TTFT (s)", "p99_ttft_s", "{:.3f}"),
    ("mean TPOT (ms)", "mean_tpot_s", "{:.2f}"),
    ("mean E2E (s)", "mean_e2e_s", "{:.3f}"),
    ("p99 E2E (s)", "p99_e2e_s", "{:.3f}"),
    ("prefix hit rate", "prefix_cache_hit_rate", "{:.1%}"),
    ("preemptions", "num_preemptions", "{}"),
    ("elapsed (s)", "elapsed_s", "{:.2f}"),
)
MILLISECONDS = {"mean_tpot_s"}


def _cell(point: dict[str, Any], key: str, fmt: str) -> str:
    value = point.get(key)
    if value is None:
        return "-"
    return fmt.format(value * 1000 if key in MILLISECONDS else value)


def markdown_table(report: dict[str, Any]) -> str:
    measured = [point for point in report["points"] if "error" not in point]
    prompt_tokens = measured[0]["prompt_tokens"] if measured else "?"
    source = f"trace `{report['trace']}`" if report.get("trace") else f"{report['workload']} workload"
    if report.get("sim_gpu"):
        where = f"- device: simulated {report['sim_gpu']} (`device=\"sim\"`, simulated time)"
    else:
        where = f"- machine: {report['machine']}, torch {report['torch']}, {report['date']}"
    lines = [
        f"# sparrow bench ablate: {source}",
        "",
        f"- model: `{report['model']}`",
        f"- requests: {report['num_prompts']} ({prompt_tokens} prompt tokens), "
        f"length scale {report['length_scale']}, seed {report['seed']}",
        f"- engine args: `{json.dumps(report['engine_args'])}`",
        where,
        "",
        "| point | " + " | ".join(header for header, _, _ in COLUMNS) + " |",
        "| --- | " + " | ".join("---:" for _ in COLUMNS) + " |",
    ]
    for point in report["points"]:
        if "error" in point:
            error = point["error"].replace("|", "\\|")
            lines.append(f"| {point['label']} | failed: {error} |" + " - |" * (len(COLUMNS) - 1))
            continue
        cells = [_cell(point, key, fmt) for _, key, fmt in COLUMNS]
        lines.append(f"| {point['label']} | " + " | ".join(cells) + " |")
    if len(report["points"]) < report.get("num_points", len(report["points"])):
        lines += ["", f"(stopped after {len(report['points'])} of {report['num_points']} points)"]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path, chart: bool) -> tuple[str, bool]:
    """Write results.json and results.md (and, with ``chart``, results.png) to ``out_dir``;
    (the table, whether the chart was drawn)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(report)
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    (out_dir / "results.md").write_text(table)
    return table, chart and write_chart(report, out_dir / "results.png")


def write_chart(report: dict[str, Any], path: Path) -> bool:
    """Draw the chart; False when matplotlib is missing (it is an extra, not needed to run)."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt
    import numpy as np

    points = [point for point in report["points"] if "error" not in point]
    if not points:
        return False
    labels = [point["label"] for point in points]
    x = np.arange(len(points))
    width = 0.4
    fig, (ax_tput, ax_ttft, ax_lat, ax_hit) = plt.subplots(1, 4, figsize=(min(36, 10 + 1.5 * len(points)), 4.5))
    ax_tput.bar(x, [p["output_tok_s"] for p in points], color="tab:blue")
    ax_tput.set_title("output throughput (tok/s)")
    ax_ttft.bar(x - width / 2, [p.get("mean_ttft_s") or 0.0 for p in points], width, label="mean TTFT (s)",
                color="tab:orange")
    ax_ttft.bar(x + width / 2, [(p.get("mean_tpot_s") or 0.0) * 1000 for p in points], width,
                label="mean TPOT (ms)", color="tab:olive")
    ax_ttft.set_title("time to first token / per output token")
    ax_ttft.legend()
    ax_lat.bar(x - width / 2, [p["mean_e2e_s"] for p in points], width, label="mean", color="tab:green")
    ax_lat.bar(x + width / 2, [p["p99_e2e_s"] for p in points], width, label="p99", color="tab:red")
    ax_lat.set_title("end-to-end latency (s)")
    ax_lat.legend()
    ax_hit.bar(x, [100 * p["prefix_cache_hit_rate"] for p in points], color="tab:purple")
    for index, point in enumerate(points):
        if point.get("num_preemptions"):
            ax_hit.annotate(f"{point['num_preemptions']} preempted", (index, 2), ha="center", fontsize=7,
                            rotation=90, va="bottom")
    ax_hit.set_title("prefix-cache hit rate (%)")
    ax_hit.set_ylim(0, 100)
    for ax in (ax_tput, ax_ttft, ax_lat, ax_hit):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    where = f", simulated {report['sim_gpu']}" if report.get("sim_gpu") else ""
    source = "trace" if report.get("trace") else report["workload"]
    fig.suptitle(f"sparrow bench ablate: {source} ({report['num_prompts']} requests{where})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
