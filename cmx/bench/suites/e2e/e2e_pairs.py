"""The pure parts of a paired engine comparison: the order requests run in, their prompts, and
the interval of a ratio of medians (``cmx.bench.harness.intervals``, named here too).

Engines with and without a connector run in separate processes, one request at a time. Each
repetition sends one request of every variant, in an order rotated by one each repetition
(A B, then B A, ...): a variant that always ran right after another would carry the other's
background work (a connector's stores finishing) in its figures.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from cmx.bench.harness.intervals import Interval, ratio_interval

__all__ = ["VOCAB", "Interval", "Slot", "prompt_ids", "prompt_seed", "ratio_interval",
           "schedule"]

VOCAB = (1000, 40000)  # token ids drawn from here: ordinary text tokens of SmolLM2


@dataclass(frozen=True)
class Slot:
    """One request of the schedule: its prompt length, repetition and variant."""

    tokens: int
    rep: int
    variant: str


def schedule(variants: Sequence[str], reps: int, lengths: Sequence[int]) -> list[Slot]:
    """Every (length, repetition, variant) once: by length, then repetition; within a
    repetition the variants rotated left by the repetition's number."""
    if not variants:
        raise ValueError("schedule of no variants")
    k = len(variants)
    return [Slot(n, rep, variants[(rep + i) % k])
            for n in lengths for rep in range(reps) for i in range(k)]


def prompt_seed(slot: Slot, salt: int = 0) -> int:
    """A seed of its own for each slot's prompt: every request's prompt is fresh."""
    return zlib.crc32(f"{salt}:{slot.tokens}:{slot.rep}:{slot.variant}".encode())


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn uniformly from ``VOCAB`` with Python's Mersenne Twister at ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(n)]
