"""Capacity at a service level: the highest offered load whose TTFT p99 meets a target.

A run at a fixed load says how an overloaded queue grows; capacity says how much traffic a
strategy serves within its service level. For each seed (each its own trace), loads are
searched on a grid of ``resolution`` steps, at most ``max_load``:

1. bracket: from ``start_load``, double the load while the p99 meets the target (or halve it
   while it does not), until one grid load meets it and a higher one misses it;
2. bisect the bracket down to adjacent grid loads, so the load one step above the capacity
   was simulated and missed.

A load "meets" the target when the TTFT p99 of every request of its run (all run to
completion, the cold start included) is at most the target. If p99 is not monotone in load,
the search finds one crossing. Every seed stops after ``max_simulations`` runs, with what it
has. Capacity over seeds is the median of the seeds' capacities, with a 95% percentile
bootstrap interval of the median (fixed resampling seed) from 5 seeds on, min-max below.
The same seeds give the same answer, run after run.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cmx.simulate.config import SimConfig
from cmx.simulate.engine import Simulator
from cmx.simulate.scenarios import scenario
from cmx.simulate.strategy import Strategy

__all__ = [
    "Capacity",
    "IntervalMethod",
    "LoadPoint",
    "Measure",
    "Outcome",
    "SeedCapacity",
    "find_capacity",
    "median_interval",
    "scenario_builder",
    "ttft_p99",
]

Build = Callable[[float, int], SimConfig]  # (offered load, seed) -> the run's config
Measure = Callable[[SimConfig], float]  # a config -> the TTFT p99 of its run, seconds

BOOTSTRAP_MIN_SEEDS = 5
_RESAMPLES = 10_000
_RESAMPLING_SEED = 0


class Outcome(str, enum.Enum):
    RESOLVED = "resolved"  # a load meets the target and the one a step above misses it
    MAX_LOAD = "max_load"  # max_load itself met it: capacity is at least that
    NONE = "none"  # even the lowest grid load missed it: capacity 0
    BUDGET = "budget"  # max_simulations ran out first: the highest load seen to meet it


class IntervalMethod(str, enum.Enum):
    BOOTSTRAP_95 = "bootstrap-95"  # 2.5th-97.5th percentile of resampled medians
    MIN_MAX = "min-max"  # fewer seeds than a bootstrap needs: their range


@dataclass(frozen=True)
class LoadPoint:
    load: float  # offered load: the replicas' busy share if shared prefixes were free
    rate_per_s: float  # the arrival rate of that load
    p99_s: float  # TTFT p99 of the run


@dataclass(frozen=True)
class SeedCapacity:
    seed: int
    outcome: Outcome
    met: LoadPoint | None  # the highest load that met the target; None: none did
    missed: LoadPoint | None  # the lowest load above ``met`` that missed; None: none ran
    points: tuple[LoadPoint, ...]  # every run, in order

    @property
    def load(self) -> float:
        return self.met.load if self.met else 0.0

    @property
    def rate_per_s(self) -> float:
        return self.met.rate_per_s if self.met else 0.0

    @property
    def simulations(self) -> int:
        return len(self.points)


@dataclass(frozen=True)
class Capacity:
    strategy: str
    target_p99_s: float
    resolution: float
    max_load: float
    seeds: tuple[SeedCapacity, ...]
    load: float  # median over seeds
    rate_per_s: float  # median over seeds
    load_interval: tuple[float, float]
    rate_interval: tuple[float, float]
    interval: IntervalMethod
    p99_s: float | None  # median over seeds of the p99 at each one's capacity; None: no load met

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in self.seeds)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["interval"] = self.interval.value
        out["simulations"] = self.simulations
        for d, s in zip(out["seeds"], self.seeds):
            d["outcome"] = s.outcome.value
            d["load"], d["rate_per_s"] = s.load, s.rate_per_s
        return out


def scenario_builder(
    name: str,
    strategy: Strategy,
    *,
    nodes: int | None = None,
    duration_s: float | None = None,
    model: str | None = None,
    host_cores: int | None = None,
    process_threads: int = 1,
    routing: str = "least-loaded",
) -> Build:
    """The named scenario under ``strategy`` at any load and seed (``scenarios.scenario``)."""

    def build(load: float, seed: int) -> SimConfig:
        return scenario(
            name,
            strategy=strategy,
            nodes=nodes,
            duration_s=duration_s,
            load=load,
            model=model,
            seed=seed,
            host_cores=host_cores,
            process_threads=process_threads,
            routing=routing,
        )

    return build


def find_capacity(
    build: Build,
    *,
    target_p99_s: float = 10.0,
    seeds: int = 5,
    first_seed: int = 0,
    resolution: float = 0.02,
    start_load: float = 0.5,
    max_load: float = 4.0,
    max_simulations: int = 20,
    log: Callable[[str], None] | None = None,
    measure: Measure | None = None,
) -> Capacity:
    """Capacity of ``build``'s system at ``target_p99_s``, over seeds ``first_seed`` on.

    ``measure`` gives the TTFT p99 of one config; by default, a run of the simulator.
    """
    if not target_p99_s > 0:
        raise ValueError(f"the p99 target must be > 0 s, got {target_p99_s}")
    if seeds < 1:
        raise ValueError(f"at least one seed needed, got {seeds}")
    if not 0 < resolution <= max_load:
        raise ValueError(f"resolution must be in (0, max_load={max_load}], got {resolution}")
    if not 0 < start_load <= max_load:
        raise ValueError(f"start_load must be in (0, max_load={max_load}], got {start_load}")
    if max_simulations < 1:
        raise ValueError(f"max_simulations must be >= 1, got {max_simulations}")
    found = tuple(
        _search(
            build,
            seed,
            target_p99_s,
            resolution,
            start_load,
            max_load,
            max_simulations,
            measure or ttft_p99,
            log,
        )
        for seed in range(first_seed, first_seed + seeds)
    )
    loads = np.array([s.load for s in found])
    rates = np.array([s.rate_per_s for s in found])
    met = [s.met.p99_s for s in found if s.met]
    load_lo, load_hi, method = median_interval(loads)
    rate_lo, rate_hi, _ = median_interval(rates)
    return Capacity(
        strategy=build(start_load, first_seed).strategy.name,
        target_p99_s=target_p99_s,
        resolution=resolution,
        max_load=max_load,
        seeds=found,
        load=float(np.median(loads)),
        rate_per_s=float(np.median(rates)),
        load_interval=(load_lo, load_hi),
        rate_interval=(rate_lo, rate_hi),
        interval=method,
        p99_s=float(np.median(met)) if met else None,
    )


def median_interval(x: np.ndarray) -> tuple[float, float, IntervalMethod]:
    """A 95% percentile bootstrap interval of the median, or min-max under 5 values."""
    if len(x) < BOOTSTRAP_MIN_SEEDS:
        return float(x.min()), float(x.max()), IntervalMethod.MIN_MAX
    rng = np.random.default_rng(_RESAMPLING_SEED)
    medians = np.median(x[rng.integers(0, len(x), (_RESAMPLES, len(x)))], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(lo), float(hi), IntervalMethod.BOOTSTRAP_95


def ttft_p99(config: SimConfig) -> float:
    """TTFT p99 over every request of one run, each run to completion."""
    return float(Simulator(config).run().ttft_s.p99)


class _Budget(Exception):
    pass


def _search(
    build: Build,
    seed: int,
    target: float,
    resolution: float,
    start_load: float,
    max_load: float,
    max_simulations: int,
    measure: Measure,
    log: Callable[[str], None] | None,
) -> SeedCapacity:
    """One seed's bracket and bisection on the grid ``k * resolution``, k in 1..top."""
    top = max(1, math.floor(max_load / resolution + 1e-9))
    runs: dict[int, LoadPoint] = {}
    order: list[LoadPoint] = []

    def meets(k: int) -> bool:
        if k not in runs:
            if len(order) >= max_simulations:
                raise _Budget
            load = round(k * resolution, 12)
            config = build(load, seed)
            p99 = measure(config)
            runs[k] = LoadPoint(load, config.workload.rate_per_s, p99)
            order.append(runs[k])
            if log:
                log(
                    f"{config.strategy.name} seed {seed}: load {load:g} "
                    f"({config.workload.rate_per_s:.2f}/s): TTFT p99 {p99:.2f} s"
                )
        return runs[k].p99_s <= target

    lo: int | None = None  # highest grid step known to meet the target
    hi: int | None = None  # lowest grid step above lo known to miss it
    outcome = Outcome.RESOLVED
    try:
        k = min(top, max(1, round(start_load / resolution)))
        if meets(k):
            lo = k
            while hi is None and lo < top:
                k = min(top, 2 * lo)
                lo, hi = (k, None) if meets(k) else (lo, k)
        else:
            hi = k
            while lo is None and hi > 1:
                k = max(1, hi // 2)
                lo, hi = (k, hi) if meets(k) else (None, k)
        if lo is None:
            outcome = Outcome.NONE
        elif hi is None:
            outcome = Outcome.MAX_LOAD
        else:
            while hi - lo > 1:
                k = (lo + hi) // 2
                lo, hi = (k, hi) if meets(k) else (lo, k)
    except _Budget:
        outcome = Outcome.BUDGET
    return SeedCapacity(
        seed,
        outcome,
        runs[lo] if lo is not None else None,
        runs[hi] if hi is not None else None,
        tuple(order),
    )
