"""Bootstrap intervals of a ratio of medians, and paired repetitions to measure one from.

Every ratio here is ``median(a) / median(b)``: the median of one side's repetitions over the
median of the other's. No suite judges a per-pair statistic by a ratio (a median of
``a[i] / b[i]``); the one per-pair statistic is a difference, ``Figure.paired_difference``
("verified load - unverified load"), whose samples are ``a[i] - b[i]`` before their median,
and which is then a ratio of medians like any other (the differences' over ``a``'s).

Two intervals, which differ only in how repetitions are drawn:

- ``ratio_interval``: ``a[i]`` and ``b[i]`` were measured in the same repetition (alternated
  back to back, ``alternated``), so a resample draws the same indices for both sides and keeps
  what a repetition shares (the machine's state at that moment) on both. Suites that alternate
  their variants (``copies``, ``million`` and ``e2e-miss`` among them) give this one to their
  figures.
- ``independent_ratio_interval``: the two sides were measured apart (one after the other, or
  in another process), so each is resampled on its own. ``Figure`` judges every figure given
  no interval by this one.

A figure that compares two variants on a busy machine is best measured in pairs: each
repetition runs both, the one that goes first swapping every repetition, so that neither
always carries the other's aftermath (a cache it warmed, background work it left).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Interval", "alternated", "independent_ratio_interval", "ratio_interval"]


@dataclass(frozen=True)
class Interval:
    """A ratio of medians and its bootstrap interval."""

    ratio: float
    low: float
    high: float
    level: float  # e.g. 0.95

    def __str__(self) -> str:
        return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}] ({self.level:.0%})"


def ratio_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> Interval:
    """median(a) / median(b), with a percentile bootstrap that draws repetitions in pairs.

    ``a[i]`` and ``b[i]`` come from the same repetition, so each resample takes the same
    indices from both; the statistic is still the ratio of the two medians, never a median of
    ``a[i] / b[i]``. With one repetition the interval is the ratio itself.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples of equal, non-zero length, got {len(a)} and {len(b)}")
    rng = random.Random(seed)
    n = len(a)
    draws = ([rng.randrange(n) for _ in range(n)] for _ in range(resamples))
    return _percentiles(a, b, level, ((idx, idx) for idx in draws))


def independent_ratio_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95,
                               resamples: int = 2000, seed: int = 0) -> Interval:
    """median(a) / median(b), with a percentile bootstrap that resamples each side on its own.

    For two sides measured apart, whose ``i``-th repetitions share nothing: ``a`` and ``b``
    may differ in length. With one repetition each the interval is the ratio itself.
    """
    if not a or not b:
        raise ValueError(f"samples on both sides, got {len(a)} and {len(b)}")
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(n) for _ in range(n)]

    return _percentiles(a, b, level, ((draw(len(a)), draw(len(b))) for _ in range(resamples)))


def _percentiles(a: Sequence[float], b: Sequence[float], level: float,
                 draws: Iterable[tuple[list[int], list[int]]]) -> Interval:
    """The ratio of medians and the ``level`` percentile interval of its resampled values,
    one per draw of indices into ``a`` and into ``b``."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    ratio = statistics.median(a) / statistics.median(b)
    ratios = sorted(statistics.median([a[i] for i in ia]) / statistics.median([b[j] for j in ib])
                    for ia, ib in draws)
    tail = (1 - level) / 2
    low = ratios[int(tail * (len(ratios) - 1))]
    high = ratios[int(round((1 - tail) * (len(ratios) - 1)))]
    return Interval(ratio, low, high, level)


def alternated(reps: int, first: Callable[[], float],
               second: Callable[[], float]) -> tuple[list[float], list[float]]:
    """``reps`` pairs of measurements, ``first``'s and ``second``'s, index by index.

    Repetition ``i`` runs ``first`` then ``second`` when ``i`` is even, ``second`` then
    ``first`` when it is odd (A B, B A, A B, ...).
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    a: list[float] = []
    b: list[float] = []
    for i in range(reps):
        if i % 2 == 0:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())
    return a, b
