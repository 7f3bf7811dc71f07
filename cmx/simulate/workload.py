"""Request traces: arrivals, context lengths, shared prefixes, tenants, bursts.

A request's context is a shared prefix (a document, a system prompt, an agent's history) that
other requests of its tenant reuse, followed by a suffix of its own. ``shared_fraction`` sets
the share of each context that is reusable: the seed article's study is 64K tokens at 75% hits.
Which of those tokens are actually found cached is what the simulation measures.

A trace is a struct of numpy arrays (no object per request, none per token), generated from a
seed: the same spec and seed give the same trace on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TenantSpec", "Trace", "WorkloadSpec", "generate"]


@dataclass(frozen=True)
class TenantSpec:
    name: str
    weight: float = 1.0  # share of the arrivals
    context_tokens: tuple[int, int] = (65_536, 65_536)  # log-uniform between the two
    shared_fraction: float = 0.75  # of each context, the part other requests reuse
    prefixes: int = 64  # distinct shared prefixes of this tenant
    zipf: float = 1.0  # popularity skew of the prefixes (0: uniform)

    def __post_init__(self) -> None:
        lo, hi = self.context_tokens
        if not 0 < lo <= hi:
            raise ValueError(f"{self.name}: context_tokens {self.context_tokens}: "
                             "not 0 < lo <= hi")
        if not 0 <= self.shared_fraction <= 1:
            raise ValueError(f"{self.name}: shared_fraction {self.shared_fraction} not in [0, 1]")
        if self.weight <= 0 or self.prefixes < 1 or self.zipf < 0:
            raise ValueError(f"{self.name}: weight > 0, prefixes >= 1, zipf >= 0 needed")


@dataclass(frozen=True)
class WorkloadSpec:
    tenants: tuple[TenantSpec, ...]
    rate_per_s: float  # mean arrivals per second outside bursts
    duration_s: float
    burst_every_s: float = 0.0  # 0: no bursts
    burst_len_s: float = 0.0
    burst_factor: float = 1.0  # arrival rate during a burst, times the base rate
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ValueError("a workload needs at least one tenant")
        if self.rate_per_s <= 0 or self.duration_s <= 0:
            raise ValueError(f"rate {self.rate_per_s} and duration {self.duration_s} must be > 0")
        if self.burst_every_s < 0 or self.burst_len_s < 0 or self.burst_factor < 1:
            raise ValueError("bursts need every >= 0, len >= 0, factor >= 1")
        if self.burst_every_s and self.burst_len_s > self.burst_every_s:
            raise ValueError(f"a burst of {self.burst_len_s} s does not fit every "
                             f"{self.burst_every_s} s")

    def rate_at(self, t: np.ndarray) -> np.ndarray:
        if not self.burst_every_s or not self.burst_len_s:
            return np.full(t.shape, self.rate_per_s)
        in_burst = np.mod(t, self.burst_every_s) < self.burst_len_s
        return np.where(in_burst, self.rate_per_s * self.burst_factor, self.rate_per_s)


@dataclass(frozen=True)
class Trace:
    """One row per request, in arrival order. Tokens are multiples of ``unit``."""

    arrival_s: np.ndarray  # float64
    tenant: np.ndarray  # int32, index into the spec's tenants
    prefix: np.ndarray  # int64, a global id of the shared prefix (unique across tenants)
    shared_tokens: np.ndarray  # int64, the reusable prefix's length
    context_tokens: np.ndarray  # int64, the whole context
    unit: int

    def __len__(self) -> int:
        return len(self.arrival_s)


def generate(spec: WorkloadSpec, unit: int) -> Trace:
    """The trace of ``spec``; lengths rounded to ``unit`` tokens (at least one unit each)."""
    rng = np.random.default_rng(spec.seed)
    peak = spec.rate_per_s * spec.burst_factor
    # Thinning: a Poisson process at the peak rate, each arrival kept with rate(t) / peak.
    n = rng.poisson(peak * spec.duration_s)
    t = np.sort(rng.uniform(0.0, spec.duration_s, n))
    t = t[rng.uniform(0.0, 1.0, n) < spec.rate_at(t) / peak]
    n = len(t)
    weights = np.array([x.weight for x in spec.tenants], dtype=float)
    tenant = rng.choice(len(spec.tenants), size=n, p=weights / weights.sum()).astype(np.int32)
    prefix = np.zeros(n, np.int64)
    context = np.zeros(n, np.int64)
    shared = np.zeros(n, np.int64)
    base = 0
    for i, ts in enumerate(spec.tenants):
        rows = np.flatnonzero(tenant == i)
        ranks = np.arange(1, ts.prefixes + 1, dtype=float) ** -ts.zipf
        prefix[rows] = base + rng.choice(ts.prefixes, size=len(rows), p=ranks / ranks.sum())
        base += ts.prefixes
        lo, hi = np.log(ts.context_tokens[0]), np.log(ts.context_tokens[1])
        ctx = np.exp(rng.uniform(lo, hi, len(rows)))
        ctx_units = np.maximum(1, np.round(ctx / unit)).astype(np.int64)
        context[rows] = ctx_units * unit
        shared[rows] = np.floor(ctx_units * ts.shared_fraction).astype(np.int64) * unit
    return Trace(t, tenant, prefix, shared, context, unit)
