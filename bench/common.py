"""What every bench shares: the machine line, rounds, the tables and result lines.

Every bench measures its baseline *between* the calls it measures, round by round,
so machine noise hits both alike, and runs at least 5 rounds. A figure is reported
as the median over the rounds with the min-max spread; a ratio is taken within
each round (measured / that round's baseline) and summarised the same way.

Each bench names the figures docs/benchmarks.md may quote in a module-level
``FIGURES`` tuple and ends by printing one ``result:`` line for each (``results``);
tests/test_docs.py checks the page's rows against those names and this format.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import overload

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "MIN_ROUNDS",
    "RESULT_LINE",
    "ROOT",
    "Rounds",
    "TokenView",
    "load_line",
    "result_line",
    "results",
    "spread",
    "summary",
    "timed_ms",
]

MIN_ROUNDS = 5


def load_line() -> str:
    """Cores and load average: printed first by every bench."""
    one, five, fifteen = os.getloadavg()
    return f"machine: {os.cpu_count()} cores, load average {one:.2f} {five:.2f} {fifteen:.2f}"


def thread_cpu_ns(pid: int, tid: int | str) -> int:
    """Nanoseconds thread ``tid`` of ``pid`` has spent on a core (0 once it ended):
    ``/proc/PID/task/TID/schedstat``, Linux only."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except OSError:
        return 0


def process_cpu_ns(pid: int) -> int:
    """Nanoseconds every thread of ``pid`` has spent on a core (0 once it ended)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    return sum(thread_cpu_ns(pid, tid) for tid in tids)


def spread(values: Sequence[float]) -> tuple[float, float]:
    return min(values), max(values)


def summary(values: Sequence[float], digits: int = 2) -> str:
    """``median (min-max)``."""
    lo, hi = spread(values)
    med = statistics.median(values)
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


RESULT_LINE = re.compile(
    r"result: (?P<figure>.+) = (?P<median>[0-9.]+) \((?P<low>[0-9.]+)-(?P<high>[0-9.]+)\)"
    r" over (?P<rounds>[0-9]+) rounds?"
)
"""A ``result:`` line: ``result: FIGURE = MEDIAN (MIN-MAX) over N rounds``."""


def result_line(figure: str, values: Sequence[float], digits: int = 2) -> str:
    """The one line a bench prints for a figure docs/benchmarks.md quotes."""
    plural = "" if len(values) == 1 else "s"
    return f"result: {figure} = {summary(values, digits)} over {len(values)} round{plural}"


def results(figures: Sequence[str], *sources: Rounds, digits: int = 2) -> str:
    """A ``result:`` line per figure, read from whichever of ``sources`` measured it.

    A figure is a row's name, or ``NAME / BASELINE`` for the row's ratio to another
    within each round. One no source measured (a bench run with options that skip
    it) is printed as not measured.
    """
    lines = []
    for figure in figures:
        name, _, baseline = figure.partition(" / ")
        found = [r for r in sources if name in r.values and (not baseline or baseline in r.values)]
        if not found:
            lines.append(f"result: {figure} not measured")
            continue
        rounds = found[0]
        values = rounds.ratios(name, baseline) if baseline else rounds.values[name]
        lines.append(result_line(figure, values, digits))
    return "\n".join(lines)


def timed_ms(call: Callable[[], object], n: int) -> float:
    """Median wall time of ``n`` calls, in ms."""
    times = []
    for _ in range(n):
        begin = time.perf_counter()
        call()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


class Rounds:
    """Per-round values of named figures (one value per figure per round)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def ratios(self, name: str, baseline: str) -> list[float]:
        return [a / b for a, b in zip(self.values[name], self.values[baseline], strict=True)]

    def table(
        self,
        names: Sequence[str],
        baseline: str,
        *,
        unit: str,
        ratio_label: str,
        target: str = "",
        digits: int = 3,
    ) -> str:
        """One row per figure: median (min-max) of its values and of its per-round
        ratio to ``baseline``."""
        rounds = len(self.values[baseline])
        head = f"{'':<44}{unit + ' median (min-max)':>30}{ratio_label:>30}"
        lines = [head + (f"   {target}" if target else "")]
        for name in names:
            values = self.values[name]
            ratio = "" if name == baseline else summary(self.ratios(name, baseline))
            lines.append(f"{name:<44}{summary(values, digits):>30}{ratio:>30}")
        lines.append(f"({rounds} rounds, each ratio within its round)")
        return "\n".join(lines)


class TokenView(Sequence[int]):
    """A read-only view of a token list, as vLLM's ``Request.all_token_ids`` is (a
    ``ConstantList``): a slice is a new list, iteration walks the list."""

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)
