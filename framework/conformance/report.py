"""What a conformance run produces: one :class:`CheckResult` per check, and the table printed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

Status = Literal["pass", "FAIL", "skip", "native"]

# Column widths of the printed table; a longer cell pushes its row's detail right.
GROUP_WIDTH = 9
NAME_WIDTH = 34
RESULT_WIDTH = 6


@dataclass(slots=True)
class CheckResult:
    """The outcome of one check. ``ok`` is False only for a failure; a skipped check (what the
    platform does not offer) and an op served by the torch reference ("native") are ok."""

    group: str  # "ops", "attention" or "engine"
    name: str  # unique within its group, e.g. "rms_norm" or "greedy_vs_hf[qwen3]"
    ok: bool
    detail: str = ""
    status: Status | None = None  # shown in the table; derived from ok when None

    def __post_init__(self) -> None:
        if self.status is None:
            self.status = "pass" if self.ok else "FAIL"

    @property
    def check_id(self) -> str:
        """``group/name``: what ``only`` and the pytest plugin's test ids use."""
        return f"{self.group}/{self.name}"


class Report(list):
    """The results of a run, in check order (a list of :class:`CheckResult`)."""

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self)

    @property
    def failures(self) -> list[CheckResult]:
        return [result for result in self if not result.ok]

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for result in self:
            counts[result.status or ""] = counts.get(result.status or "", 0) + 1
        parts = [f"{counts[status]} {word}" for status, word in
                 (("pass", "passed"), ("native", "native"), ("skip", "skipped"), ("FAIL", "failed"))
                 if counts.get(status)]
        return f"{len(self)} checks: {', '.join(parts) or 'none run'}"

    def table(self) -> str:
        lines = [table_header(), *(table_row(result) for result in self), self.summary()]
        return "\n".join(lines)


def table_header() -> str:
    return _row("group", "check", "result", "detail") + "\n" + _row("-" * 5, "-" * 5, "-" * 6, "-" * 6)


def table_row(result: CheckResult) -> str:
    return _row(result.group, result.name, result.status or "", result.detail)


def _row(group: str, name: str, result: str, detail: str) -> str:
    return f"{group:<{GROUP_WIDTH}} {name:<{NAME_WIDTH}} {result:<{RESULT_WIDTH}} {one_line(detail)}".rstrip()


def one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line, cut at ``limit`` characters (a table cell, a pytest failure line)."""
    flat = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


ResultCallback = Callable[[CheckResult], None]
