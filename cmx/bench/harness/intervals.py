"""Paired repetitions: two variants alternated within each repetition, and the bootstrap
interval of a ratio of medians over such pairs.

A figure that compares two variants on a busy machine is measured in pairs: each repetition
runs both, the one that goes first swapping every repetition, so that neither always carries
the other's aftermath (a cache it warmed, background work it left). A ratio figure is the
median of one side over the median of the other (not a median of per-pair ratios); its
uncertainty is a percentile bootstrap that resamples whole pairs, the same repetitions drawn
for both sides. A difference (``Figure.paired_difference``: "verified load - unverified load")
is taken pair by pair before its median.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Interval", "alternated", "ratio_interval"]


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
    """median(a) / median(b), with a percentile bootstrap over repetitions.

    ``a[i]`` and ``b[i]`` come from the same repetition, so repetitions are resampled in pairs
    (the same indices for both). With one repetition the interval is the ratio itself.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples of equal, non-zero length, got {len(a)} and {len(b)}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    ratio = statistics.median(a) / statistics.median(b)
    rng = random.Random(seed)
    n = len(a)
    ratios = sorted(
        statistics.median([a[i] for i in idx]) / statistics.median([b[i] for i in idx])
        for idx in ([rng.randrange(n) for _ in range(n)] for _ in range(resamples)))
    tail = (1 - level) / 2
    low = ratios[int(tail * (resamples - 1))]
    high = ratios[int(round((1 - tail) * (resamples - 1)))]
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
