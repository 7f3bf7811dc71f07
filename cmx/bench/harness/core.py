"""What every suite shares: the run's settings, figures as ratios, goals, timing and cold caches.

A figure is never a bare number. It is the median of ``reps`` measurements beside the median of a
baseline measured in the same run (raw disk bandwidth with fio, or numpy memcpy), and its ratio
to that baseline is what a goal judges. The disk here is virtual and noisy, so a number from
another run, or another day, is not a baseline.

How a goal is judged (``Figure.verdict``), one rule for every suite:

- by the far end of the ratio's 95% bootstrap interval, never by the median alone: a "<=" goal
  by the interval's upper end, a ">=" goal by its lower end. The interval is the one a paired
  figure carries (``intervals.ratio_interval``), else each side resampled on its own
  (``intervals.independent_ratio_interval``);
- only on a figure that can be judged (``Figure.inconclusive``): fewer than ``MIN_REPS``
  repetitions on either side, a negative median, a baseline of zero or next to it, a
  non-finite sample, or a difference whose paired interval reaches below zero is a MISS,
  whatever the goal's side, and says why;
- a count (``Figure.count``: requests hung of those sent) is no median of repetitions but
  every trial of the run tallied, and is judged exactly as counted.

A figure that is a difference of two variants is measured in pairs and carries its interval
(``Figure.paired_difference``).
"""

from __future__ import annotations

import enum
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cmx.bench.harness.intervals import Interval, independent_ratio_interval, ratio_interval

__all__ = [
    "GB",
    "GiB",
    "KiB",
    "MIN_REPS",
    "MiB",
    "BenchConfig",
    "BenchContext",
    "Figure",
    "Goal",
    "SuiteResult",
    "Table",
    "Verdict",
    "drop_page_cache",
    "median",
    "timed",
]

# A baseline at or below this fraction of the largest magnitude among a figure's samples is ~0:
# a ratio to it says nothing (a difference of medians that cancelled, a timer's resolution).
DEGENERATE_BASELINE = 1e-6
# Fewer repetitions than this on either side of a figure: its interval says nothing (with two,
# every resample's median is one of three values), so no goal can be shown to hold.
MIN_REPS = 3

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 1e9  # bandwidths are reported in decimal GB/s, sizes in binary units


class Verdict(str, enum.Enum):
    PASS = "PASS"
    MISS = "MISS"
    INFO = "info"  # a figure with no goal: context for the others


@dataclass(frozen=True)
class Goal:
    """A bound on a figure's ratio: ``ratio >= target`` or ``ratio <= target``."""

    op: str  # ">=" or "<="
    target: float

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"goal op must be '>=' or '<=', got {self.op!r}")

    def check(self, ratio: float) -> Verdict:
        ok = ratio >= self.target if self.op == ">=" else ratio <= self.target
        return Verdict.PASS if ok else Verdict.MISS

    def __str__(self) -> str:
        return f"{'≥' if self.op == '>=' else '≤'} {self.target:g}"


def median(samples: Sequence[float]) -> float:
    if not samples:
        raise ValueError("median of no samples")
    return float(statistics.median(samples))


@dataclass(frozen=True)
class Figure:
    """One measured figure: the median of its samples over the median of its baseline's."""

    suite: str
    name: str  # what was measured, e.g. "NvmeStore put+flush, 32 MiB blocks"
    unit: str  # unit of samples and baseline_samples, e.g. "GB/s"
    samples: tuple[float, ...]  # one per repetition
    baseline_name: str  # what the baseline is, e.g. "fio write 1 MiB QD16"
    baseline_samples: tuple[float, ...]  # one per repetition, measured in the same run
    goal: Goal | None = None
    note: str = ""  # how to read it, or why it misses
    interval: Interval | None = None  # the ratio's bootstrap interval, for a paired figure
    counted: bool = False  # one tally of every trial of the run, not repetitions (``count``)
    # why the run could not judge it though it has a goal (a setup that failed, a baseline
    # that never met its limit): a MISS, inconclusive, whatever its samples
    unjudged: str = ""

    def __post_init__(self) -> None:
        if not self.counted:
            return
        one_each = len(self.samples) == len(self.baseline_samples) == 1
        values = (*self.samples, *self.baseline_samples)
        if (not one_each or not all(x >= 0 and float(x).is_integer() for x in values)
                or self.samples[0] > self.baseline_samples[0]):
            raise ValueError(f"a count is one whole number of another, no larger, got "
                             f"{self.samples} of {self.baseline_samples}")

    @classmethod
    def count(cls, suite: str, name: str, unit: str, counted: int, of: int, baseline_name: str,
              goal: Goal | None = None, note: str = "") -> Figure:
        """``counted`` of ``of`` trials of the run (requests hung of those sent): every trial
        tallied, so the share is exact and judged as it is, with no interval."""
        return cls(suite, name, unit, (float(counted),), baseline_name, (float(of),), goal,
                   note, counted=True)

    @classmethod
    def paired_difference(cls, suite: str, name: str, unit: str, a: Sequence[float],
                          b: Sequence[float], baseline_name: str, goal: Goal | None = None,
                          note: str = "") -> Figure:
        """What ``a`` adds over ``b``, judged against ``a``: ``a[i]`` and ``b[i]`` are one
        pair (the same repetition, run back to back), the figure's samples are ``a[i] - b[i]``
        and its baseline ``a``; the interval resamples whole pairs."""
        if len(a) != len(b) or not a:
            raise ValueError(f"paired samples of equal, non-zero length, got {len(a)} and "
                             f"{len(b)}")
        diffs = tuple(x - y for x, y in zip(a, b, strict=True))
        interval = ratio_interval(diffs, a) if median(a) > 0 and min(a) > 0 else None
        return cls(suite, name, unit, diffs, baseline_name, tuple(a), goal, note, interval)

    @property
    def value(self) -> float:
        return median(self.samples)

    @property
    def baseline(self) -> float:
        return median(self.baseline_samples)

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("nan")

    @property
    def reps(self) -> int:
        """Repetitions behind the figure: the fewer of its two sides'."""
        return min(len(self.samples), len(self.baseline_samples))

    @property
    def inconclusive(self) -> str | None:
        """Why no goal can be judged on this figure, or None when one can."""
        if self.unjudged:
            return self.unjudged
        samples = (*self.samples, *self.baseline_samples)
        if not all(map(math.isfinite, samples)):
            return "a sample is not a finite number"
        if not self.counted and self.reps < MIN_REPS:
            return (f"{len(self.samples)} repetition(s) against {len(self.baseline_samples)} "
                    f"of the baseline, fewer than {MIN_REPS}: no interval can show the goal "
                    f"held")
        if self.value < 0:
            return f"its median is negative ({self.value:.3g} {self.unit})"
        scale = max(abs(x) for x in samples)
        if self.baseline <= DEGENERATE_BASELINE * scale or min(self.baseline_samples) <= 0:
            return (f"its baseline is ~0 or below (median {self.baseline:.3g}, least "
                    f"{min(self.baseline_samples):.3g} {self.unit}): the ratio means nothing")
        if self.interval is not None:
            iv = self.interval
            if not all(map(math.isfinite, (iv.ratio, iv.low, iv.high))):
                return f"its interval is not finite ({iv})"
            if iv.low < 0:
                return f"its interval reaches below zero: {iv}"
        elif min(self.samples) < 0:
            return ("samples below zero (a difference) with no paired interval to judge "
                    "them by")
        return None

    @functools.cached_property
    def judged_interval(self) -> Interval | None:
        """The interval a goal is judged by: the paired one the figure carries, else a
        bootstrap with each side resampled on its own; None for a figure with no goal, a
        count, or one that cannot be judged."""
        if self.interval is not None:
            return self.interval
        if self.goal is None or self.counted or self.inconclusive is not None:
            return None
        return independent_ratio_interval(self.samples, self.baseline_samples)

    @property
    def verdict(self) -> Verdict:
        """PASS when the far end of the ratio's interval meets the goal: its upper end for a
        "<=" goal, its lower end for a ">=" one (a median that meets the goal with an interval
        crossing it does not show the goal held). A count is judged as counted."""
        if self.goal is None:
            return Verdict.INFO
        if self.inconclusive is not None:
            return Verdict.MISS  # never PASS on a figure that cannot be judged
        iv = self.judged_interval
        if iv is None:  # a count
            return self.goal.check(self.ratio)
        worst = max(iv.high, self.ratio) if self.goal.op == "<=" else min(iv.low, self.ratio)
        return self.goal.check(worst)

    def to_dict(self) -> dict[str, Any]:
        iv = self.judged_interval
        return {
            "suite": self.suite,
            "name": self.name,
            "unit": self.unit,
            "value": self.value,
            "samples": list(self.samples),
            "baseline_name": self.baseline_name,
            "baseline": self.baseline,
            "baseline_samples": list(self.baseline_samples),
            "ratio": self.ratio,
            "interval": None if iv is None else {"ratio": iv.ratio, "low": iv.low,
                                                 "high": iv.high, "level": iv.level,
                                                 "paired": self.interval is not None},
            "counted": self.counted,
            "goal": str(self.goal) if self.goal else None,
            "verdict": self.verdict.value,
            "inconclusive": self.inconclusive if self.goal else None,
            "note": self.note,
        }


@dataclass(frozen=True)
class Table:
    """A detail table a suite reports beside its figures (fio matrix, I/O size histogram)."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "headers": list(self.headers),
                "rows": [list(r) for r in self.rows]}


@dataclass
class SuiteResult:
    name: str
    command: str  # the command line that reproduces these figures
    figures: list[Figure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the suite
    error: str | None = None  # why the suite stopped before its figures, if it did

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "command": self.command,
            "seconds": self.seconds,
            "error": self.error,
            "figures": [f.to_dict() for f in self.figures],
            "tables": [t.to_dict() for t in self.tables],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class BenchConfig:
    dir: Path  # scratch directory for data files; on the filesystem under test
    reps: int = 3  # repetitions per figure; figures are medians
    gib: float = 2.0  # bytes moved per measurement of a store, in GiB
    fio_seconds: float = 3.0  # run time of one fio job
    out: Path = Path("bench-out")  # where JSON, markdown and plots go
    minutes: float = 30.0  # length of a suite that runs for a time (the soak's traffic)

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")
        if self.gib <= 0 or self.fio_seconds <= 0 or self.minutes <= 0:
            raise ValueError(f"gib, fio_seconds and minutes must be > 0, got {self.gib}, "
                             f"{self.fio_seconds}, {self.minutes}")

    @property
    def nbytes(self) -> int:
        return int(self.gib * GiB)


class BenchContext:
    """The run's settings plus what suites share: a log line sink and the cold-read method."""

    def __init__(self, config: BenchConfig, work: Path,
                 log: Callable[[str], None] = lambda _m: None) -> None:
        self.config = config
        self.work = work  # this run's own directory inside config.dir; removed after the run
        self.log = log
        self.can_drop_cache = _can_drop_cache()
        self.memo: dict[str, Any] = {}  # values one suite computes and another reuses (fio engine)

    @property
    def cold_read_method(self) -> str:
        if self.can_drop_cache:
            return ("O_DIRECT, and the page cache dropped (sync; echo 3 > drop_caches) "
                    "before each read pass")
        return ("O_DIRECT only (not root, or /proc/sys/vm/drop_caches not writable: "
                "page cache not dropped)")

    def drop_cache(self) -> bool:
        return drop_page_cache() if self.can_drop_cache else False

    def scratch(self, name: str) -> Path:
        """A directory for data files, inside this run's work directory."""
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def _can_drop_cache() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache; False where not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of ``fn()``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
